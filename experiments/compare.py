"""`shardscope compare CONFIG --systems A,B,C`: one model and workload on several systems,
side by side.

Each system gets the config's sharding where it is valid there (the validator's reason
otherwise), its batch-sharding axis scaled to the system's device count (`fit_to_devices`:
256 TPU7x chips are 512 devices), or with `--search` the fastest sharding that fits from a
search on that system. On the CPU path the compiled program depends only on the mesh and on
whether the system is a GPU (whose program saves what Transformer Engine's fused kernels
save), so it is compiled once per device count, sharding and kind and re-timed on every
such system of that size (`sharding.reanalyze`: each system's chips and links, no recompile); a
test checks this equals compiling for each.

Power, energy per token, tokens/s per MW and USD per million tokens are each report's
(meshes/power.py: the chips from idle to TDP by how busy the schedule keeps them, the
hosts, NICs and NVLink switches, the PUE; the catalog's dated price per chip-hour, or the
config's `[cost]` (its usd_per_chip_hour for systems of its own chip only), or
`--price-per-device-hour` for every system); None where no public
power figure or price exists.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Sequence

from experiments import config as config_mod
from experiments import runner
from experiments.config import ConfigError
from experiments.ranking import ranking
from sharding.compute import runs_fused_kernels
from sharding.mesh import CPU_MAX_DEVICES
from sharding.report import Report
from sharding.rules import MESH_AXES, rules_preset
from sharding.text import column_table
from sharding.units import fmt_bytes, fmt_duration, fmt_s, fmt_watts, fmt_wh


@dataclasses.dataclass(frozen=True)
class Entry:
    """One system's column."""

    system: str
    status: str  # "ok" | "refused"
    message: str = ""
    report: Report | None = None
    parallelism: dict = dataclasses.field(default_factory=dict)
    retimed_from: str = ""  # the system whose compile was re-timed ("" when compiled)
    note: str = ""  # how the config's sharding was fitted to the system, or found
    overrides: dict = dataclasses.field(default_factory=dict)  # the config's, where applied
    # chips within a power budget and runs of N tokens (meshes.power.Energy.scale_out)
    scale_out: dict | None = None

    @property
    def label(self) -> str:
        """The system's name, with the config's overrides applied to it (System.label)."""
        from meshes import get_system

        return get_system(self.system, **self.overrides).label

    def _energy(self, figure: str) -> float | None:
        """A figure of the step's energy and cost (meshes/power.py), None where the system
        did not run or no public figure exists."""
        e = self.report.energy if self.report else None
        return None if e is None else getattr(e, figure)

    @property
    def power_w(self) -> float | None:
        """The facility's draw running the step."""
        return self._energy("power_w")

    @property
    def joules_per_token(self) -> float | None:
        return self._energy("joules_per_token")

    @property
    def usd_per_million_tokens(self) -> float | None:
        return self._energy("usd_per_million_tokens")

    @property
    def tokens_per_s_per_chip(self) -> float | None:
        """Per physical chip (a TPU7x chip is two JAX devices)."""
        from meshes import get_system

        r = self.report
        if r is None or r.tokens_per_s is None:
            return None
        return r.tokens_per_s / (r.num_devices / get_system(self.system).chip.devices_per_chip)

    @property
    def tokens_per_s_per_mw(self) -> float | None:
        return self._energy("tokens_per_s_per_mw")

    def to_dict(self) -> dict:
        r = self.report
        return {
            "system": self.system, "status": self.status, "message": self.message,
            "parallelism": self.parallelism, "retimed_from": self.retimed_from or None,
            "note": self.note or None,
            "extrapolated_from": (r.extrapolated_from or None) if r else None,
            "step_time_s": r.step_time_s if r else None,
            "tokens_per_s": r.tokens_per_s if r else None,
            "tokens_per_s_per_device": r.tokens_per_s_per_device if r else None,
            "tokens_per_s_per_chip": self.tokens_per_s_per_chip,
            "mfu": r.mfu if r else None, "bottleneck": r.bottleneck() if r else None,
            "fits": r.fits if r else None,
            "memory_per_device_bytes": r.memory_per_device_bytes if r else None,
            # what "fits" is read against: the chip's HBM per device (meshes/chips.py)
            "hbm_capacity_bytes": r.hbm_capacity_bytes if r else None,
            "power_w": self.power_w, "joules_per_token": self.joules_per_token,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "tokens_per_s_per_mw": self.tokens_per_s_per_mw,
            "power": r.energy.to_dict() if r and r.energy else None,
            "scale_out": self.scale_out,
        }


def fit_to_devices(raw: dict, num_devices: int) -> str:
    """Fit the config's sharding to a system of another device count, in place, and say
    what changed ("" when nothing did or nothing fits: the validator then says why).

    First the batch-sharding axis (fsdp where it is used, else data) takes the ratio, or
    `tensor` where the batch would not split that many ways, the global batch kept (256
    TPU7x chips are 512 devices, so they run twice the ways of 256 GPUs). Where the counts
    are not multiples (72 GPUs of a rack against 64 of eight nodes), the axes that do not
    shard the batch stay, FSDP keeps the largest share of its ways that divides what is
    left, data takes the rest, and the global batch keeps the config's sequences per
    data-parallel replica when it no longer splits."""
    par = raw.setdefault("parallelism", {})
    total = math.prod(int(par.get(a, 1)) for a in MESH_AXES)
    if num_devices == total:
        return ""
    work = raw.get("workload", {})
    micro = (int(work["global_batch"]) // int(work.get("microbatches", 1))
             if "global_batch" in work else 0)
    batch_axes = rules_preset(par.get("rules", "default")).mesh_axes("batch")
    batch_ways = math.prod(int(par.get(a, 1)) for a in batch_axes)
    for axis in ("fsdp" if int(par.get("fsdp", 1)) > 1 else "data", "tensor"):
        old = int(par.get(axis, 1))
        if num_devices % total == 0:
            new = old * (num_devices // total)
        elif total % num_devices == 0 and old % (total // num_devices) == 0:
            new = old // (total // num_devices)
        else:
            continue
        ways = batch_ways * new // old if axis != "tensor" else batch_ways
        if micro % ways == 0:  # the batch still splits: else the next axis takes it
            par[axis] = new
            return f"{axis} {old} -> {new} for its {num_devices} devices"
    return _refit_batch_axes(raw, par, num_devices, micro, batch_ways)


def _refit_batch_axes(raw: dict, par: dict, num_devices: int, micro: int,
                      batch_ways: int) -> str:
    """`fit_to_devices` where the device counts are not multiples: data and fsdp re-split
    what the other axes leave; the sequences per replica kept when the batch must change."""
    other = math.prod(int(par.get(a, 1)) for a in MESH_AXES if a not in ("data", "fsdp"))
    if num_devices % other:
        return ""
    left = num_devices // other
    old = {a: int(par.get(a, 1)) for a in ("data", "fsdp")}
    fsdp = math.gcd(old["fsdp"], left)
    new = {"data": left // fsdp, "fsdp": fsdp}
    par.update(new)
    changed = [f"{a} {old[a]} -> {new[a]}" for a in ("data", "fsdp") if old[a] != new[a]]
    new_ways = batch_ways // (old["data"] * old["fsdp"]) * left
    work = raw.get("workload", {})
    if micro and micro % new_ways and micro % batch_ways == 0:
        per_replica = micro // batch_ways
        k = int(work.get("microbatches", 1))
        old_batch = int(work["global_batch"])
        work["global_batch"] = per_replica * new_ways * k
        changed.append(f"global_batch {old_batch} -> {work['global_batch']} ({per_replica} "
                       f"sequences per data-parallel replica, as the config)")
    return f"{', '.join(changed)} for its {num_devices} devices"


def compare(raw: dict, systems: Sequence[str], *, calibration=None,
            price_per_device_hour: float | None = None, search: dict | None = None,
            on_result=None) -> list[Entry]:
    """Each system's estimate of the config's step (XLA:CPU; one compile per device count
    and sharding): the config's sharding fitted to the system's device count
    (`fit_to_devices`), or with `search` ({"store": path, "axes": (...), "workers": n,
    "budget": n}) the fastest sharding that fits from a search on that system (stored, so
    a rerun compiles nothing new)."""
    import sharding
    from meshes import get_system

    if not systems:
        raise ConfigError("--systems: give at least one system, e.g. --systems "
                          "h100:64,b200:64,gb200-nvl72:64")
    compiled: dict[tuple, tuple[str, Report]] = {}
    out = []
    devices: dict[str, int] = {}
    for name in systems:  # a misspelt name is the user's mistake: before any compile
        try:
            devices[name] = get_system(name).num_devices
        except ValueError as e:
            raise ConfigError(f"--systems: {name!r}: {e}") from None
    try:  # JAX's CPU backend fakes one device count per process: the largest
        sharding.ensure_cpu_devices(min(max(devices.values()), CPU_MAX_DEVICES))
    except ValueError:
        pass  # already started smaller (tests, notebooks): a system past it says so
    own = raw.get("system", {})
    overrides = {k: v for k, v in own.items() if k != "name"}
    family = str(own.get("name", "")).split(":")[0]
    own_chip = get_system(str(own.get("name", ""))).chip.name
    for name in systems:
        r = copy.deepcopy(raw)
        # the config's network overrides (nic_gbps, gpus_per_domain, ...) describe its own
        # cluster: kept for systems of the same kind, and said to be left out of the others
        same = name.split(":")[0] == family
        applied = copy.deepcopy(overrides) if same else {}
        r["system"] = {"name": name, **applied}
        n = devices[name]
        note = fit_to_devices(r, n)
        if overrides and not same:
            left = (f"the config's [system] {', '.join(sorted(overrides))} describe its "
                    f"{family} cluster: not applied here")
            note = f"{note}; {left}" if note else left
        if search is not None:
            r, note, why = _searched(r, name, n, search, calibration, on_result)
            if r is None:
                out.append(Entry(name, "refused", why, overrides=applied))
                continue
        try:
            exp = config_mod.from_dict(r)
        except ConfigError as e:
            out.append(Entry(name, "refused", str(e).splitlines()[0], note=note,
                             overrides=applied))
            continue
        if price_per_device_hour is not None:
            exp = dataclasses.replace(exp, cost=dataclasses.replace(
                exp.cost,
                usd_per_chip_hour=price_per_device_hour * exp.system.chip.devices_per_chip))
        elif exp.cost.usd_per_chip_hour is not None and exp.system.chip.name != own_chip:
            # the config's price is its own chip's, as its network overrides are its own
            # cluster's: an H100's $2 priced a B200 and a TPU v6e at $2 too
            exp = dataclasses.replace(exp, cost=dataclasses.replace(
                exp.cost, usd_per_chip_hour=None))
            left = (f"the config's [cost] usd_per_chip_hour prices its {own_chip}: not "
                    f"applied here (--price-per-device-hour prices every system)")
            note = f"{note}; {left}" if note else left
        sizes = {a: s for a, s in exp.parallelism.sizes().items() if s > 1}
        # one compile per device count and sharding, GPU and TPU programs apart (a GPU
        # system's program saves what Transformer Engine's fused kernels save)
        key = (n, runs_fused_kernels(exp.system.chip), json.dumps(r["parallelism"],
                                                                sort_keys=True))
        if key in compiled:
            first, rep = compiled[key]
            report = sharding.reanalyze(
                dataclasses.replace(rep.inputs, name=exp.name, fit_advice=()),
                system=exp.system, calibration=calibration, cost=exp.cost)
            out.append(Entry(name, "ok", report=report, parallelism=sizes, retimed_from=first,
                             note=note, overrides=applied))
            continue
        try:
            report = runner.run(exp, backend="cpu", calibration=calibration)
        except ConfigError as e:
            out.append(Entry(name, "refused", str(e).splitlines()[0], note=note,
                             overrides=applied))
            continue
        compiled[key] = (name, report)
        out.append(Entry(name, "ok", report=report, parallelism=sizes, note=note,
                         overrides=applied))
    return out


def _searched(r: dict, name: str, n: int, opts: dict, calibration, on_result):
    """(the config with the fastest sharding that fits on `name`, a note, why not)."""
    from experiments import search as search_mod
    from experiments.store import Store

    label = f"compare {r['name']} on {name}"
    with Store(opts["store"]) as store:
        outcome = search_mod.run_search(
            r, num_devices=n, axes=opts.get("axes", search_mod.DEFAULT_AXES), vary=(),
            store=store, search=label, workers=opts.get("workers"), budget=opts.get("budget"),
            calibration=opts.get("calibration"), on_result=on_result)
        ranked = ranking(outcome.rows)  # its own candidates, whoever stored them first
    if not ranked:
        return None, "", f"the search on {name} found no sharding that runs and fits"
    best = ranked[0]
    shape = ", ".join(f"{a} {s}" for a, s in best.parallelism.items() if s > 1)
    out = copy.deepcopy(best.config)
    out["name"] = r["name"]
    return out, f"searched: {shape} fastest of {len(ranked)} that fit", ""


def with_scale_out(entries: Sequence[Entry], *, power_budget_w: float | None = None,
                   tokens: float | None = None) -> list[Entry]:
    """Each system's chips within `power_budget_w` and its runs of `tokens`."""
    if power_budget_w is None and tokens is None:
        return list(entries)
    from meshes import get_system
    from meshes.power import replica_chips

    return [dataclasses.replace(e, scale_out=e.report.energy.scale_out(
        power_budget_w=power_budget_w, tokens=tokens, replica_chips=replica_chips(
            e.report.num_devices, e.parallelism.get("data", 1),
            get_system(e.system).chip.devices_per_chip)))
        if e.report and e.report.energy else e for e in entries]


def _scale_out_rows(entries: Sequence[Entry]) -> list:
    """Rows for the budget's chips and the runs' wall time and energy, where asked."""
    first = next((e.scale_out for e in entries if e.scale_out), None)
    if first is None:
        return []
    budget, tokens = first["power_budget_w"], first["tokens"]

    def get(e: Entry, *keys):
        v = e.scale_out
        for k in keys:
            v = None if v is None else v.get(k)
        return v

    rows = []
    if budget is not None:
        rows.append((f"chips in {fmt_watts(budget)}", lambda e: None if get(
            e, "chips_within_budget") is None else f"{get(e, 'chips_within_budget'):,}"))
    if tokens is not None:
        rows.append((f"{tokens:.3g} tokens, these chips", lambda e: None if get(
            e, "run") is None else fmt_duration(get(e, "run", "time_s"))))
        if budget is not None:
            rows.append((f"{tokens:.3g} tokens in {fmt_watts(budget)}", lambda e: None if get(
                e, "run_within_budget") is None else fmt_duration(
                get(e, "run_within_budget", "time_s"))))
        rows.append((f"{tokens:.3g} tokens: energy", lambda e: None if get(
            e, "run", "energy_j") is None else fmt_wh(get(e, "run", "energy_j"))))
        rows.append((f"{tokens:.3g} tokens: USD", lambda e: None if get(
            e, "run", "usd") is None else f"${get(e, 'run', 'usd'):,.0f}"))
    return rows


def _compiled(e: Entry) -> str:
    """How the column's program was had: compiled, re-timed from another system's compile,
    and whether with fewer data-parallel replicas read as the full run (runner.run)."""
    how = [f"re-timed from {e.retimed_from}"] if e.retimed_from else []
    if e.report.extrapolated_from:
        how.append("extrapolated")
    return ", ".join(how) or "yes"


def format_compare(entries: Sequence[Entry]) -> str:
    from meshes import get_system

    def cell(e: Entry, fn) -> str:
        if e.report is None:
            return "refused"
        try:
            v = fn(e)
        except (TypeError, ZeroDivisionError):
            return "-"
        return "-" if v is None else v

    def chip_of(e: Entry):
        return get_system(e.system, **e.overrides).chip

    def per_device_links(e: Entry) -> str:
        # A torus's figure is one of a chip's several links (ICI: four on v5e and v6e, six
        # on v5p), not a device's whole bandwidth as NVLink's is: say so beside it.
        s = get_system(e.system, **e.overrides)

        def unit(link) -> str:
            scope = s.link_scope(link.name)
            return "/link" if scope == "per link" else (
                "/chip" if scope == "per chip" and s.chip.devices_per_chip > 1 else "")

        return ", ".join(f"{link.name} {link.bytes_per_s / 1e9:.0f}{unit(link)}"
                         for link in s.links.values())

    rows = [
        ("step time", lambda e: fmt_s(e.report.step_time_s)),
        ("tokens/s", lambda e: f"{e.report.tokens_per_s:,.0f}"),
        ("tokens/s per chip", lambda e: f"{e.tokens_per_s_per_chip:,.0f}"),
        ("MFU", lambda e: f"{e.report.mfu:.1%}"),
        ("memory/device", lambda e: fmt_bytes(e.report.memory_per_device_bytes)
         + ("" if e.report.fits else " (no fit)")),
        # the HBM "fits" is read against (`shardscope systems` says what the figure is)
        ("HBM/device", lambda e: fmt_bytes(e.report.hbm_capacity_bytes)),
        ("HBM TB/s per chip",
         lambda e: f"{chip_of(e).hbm_bytes_per_s * chip_of(e).devices_per_chip / 1e12:.2f}"),
        ("links GB/s per device", per_device_links),
        ("power (facility)", lambda e: None if e.power_w is None else fmt_watts(e.power_w)),
        ("energy per token", lambda e: None if e.joules_per_token is None
         else f"{e.joules_per_token:.4g} J"),
        ("tokens/s per MW", lambda e: None if e.tokens_per_s_per_mw is None
         else f"{e.tokens_per_s_per_mw:,.0f}"),
        ("USD per M tokens", lambda e: None if e.usd_per_million_tokens is None
         else f"{e.usd_per_million_tokens:.4g}"),
        *_scale_out_rows(entries),
        ("compiled", _compiled),
    ]
    table = [(what, [cell(e, fn) for e in entries]) for what, fn in rows]
    lines = column_table([e.label for e in entries], table)
    for e in entries:
        lines.append(f"{e.label}: " + (e.report.bottleneck() if e.report else e.message)
                     + (f" [{e.note}]" if e.note else ""))
    lines.append("power: chips (idle to TDP by how busy the schedule keeps them), hosts, NICs "
                 "and NVLink switches, times the PUE (meshes/power.py); '-' where no public "
                 "power figure or price exists")
    # the systems whose power is not that: counted alone, a GB300 rack's chips read below a
    # GB200 rack's whole draw
    for e in entries:
        energy = e.report.energy if e.report else None
        if energy is not None and energy.power_w is not None and energy.rest_w is None:
            lines.append(f"power of {e.label}: {energy.counted}")
    return "\n".join(lines)
