"""Power, energy and cost of a step: what the machine draws while it runs the schedule, what
the building around it adds, and what the chip-hours cost.

The model, from the bottom up:

- A chip draws `IDLE_FRACTION` of its spec TDP when it waits (on a collective it cannot
  hide, in a pipeline bubble) and its TDP while it runs a kernel, math- or memory-bound:
  `chip_w = tdp * (idle + (1 - idle) * busy)`, `busy` the share of the scheduled step its
  compute stream is occupied (`Report.compute_s / step_time_s`). TDP is what a chip is
  built to sustain on its heaviest kernels (dense GEMMs hold data-centre GPUs at their power
  cap); counting memory-bound kernels at TDP too is an upper bound, said in the report.
- The rest of the machine (host CPUs and memory, NICs, NVLink switches, fans): the node's
  datasheet maximum less its GPUs' TDP, times the share of it a node draws under training,
  `REST_SHARE`, which one measurement fixes: an 8 x H100 HGX node peaked at 8.4 kW of its
  10.2 kW rating while training with its GPUs near full use (Latif et al. 2024,
  arXiv:2412.08602), i.e. (8.4 - 8 x 0.7) / (10.2 - 8 x 0.7) = 61% of the non-GPU rating.
  As a check, not a fit: at the ~90% busy of a large dense training step the model gives
  7.9 kW per node, where Newkirk et al. 2025 (arXiv:2506.14551) measure compute-intensive
  training at 76% of the 10.2 kW rating, 7.75 kW.
- Where only a whole-pod figure is public (TPU7x), it is taken as the pod's draw at full
  load and scaled by the same idle/busy rule.
- Scale-out switches outside the nodes are not counted (no public per-port figure in the
  reference), nor storage.
- The facility draws the IT power times the PUE: `[cost] pue`, else the operator's published
  fleet figure where one operator runs the system (Google's, for TPUs), else an industry
  survey's average (`facility_pue`).

Energy per step is the facility power times the step; per token, divided by the step's
tokens. Cost per step is the chip-hours at `[cost] usd_per_chip_hour` plus, where power is
billed apart (owned machines: the chip-hour price is then the amortised hardware),
the facility energy at `[cost] usd_per_kwh`. Catalog defaults below carry their source and
the date they were read; prices move monthly, so a real plan sets its own.
"""

from __future__ import annotations

import dataclasses
import math

# A chip waiting draws this share of its TDP. No vendor publishes an idle figure; public
# nvidia-smi telemetry of data-centre GPUs holding a CUDA context reads ~10-15% of TDP
# (an H100 70-100 W; arXiv:2605.23918 measures the context alone at +26-50 W over bare
# idle on H100 and A100). The upper end is taken.
IDLE_FRACTION = 0.15

# Share of a node's non-GPU rating drawn under training: (8.4 kW measured peak - 8 x 700 W)
# / (10.2 kW rated - 8 x 700 W), 8 x H100 HGX (Latif et al. 2024, arXiv:2412.08602).
_H100_NODE_PEAK_W, _H100_NODE_RATED_W, _H100_TDP_W = 8400.0, 10200.0, 700.0
REST_SHARE = (_H100_NODE_PEAK_W - 8 * _H100_TDP_W) / (_H100_NODE_RATED_W - 8 * _H100_TDP_W)


@dataclasses.dataclass(frozen=True)
class NodeRating:
    """A node's (or rack's) datasheet maximum power and the chips it holds."""

    chips: int
    rated_w: float
    source: str


# By system family: the node whose rating covers the chips, hosts, NICs and NVLink switches.
NODE_RATINGS: dict[str, NodeRating] = {
    "a100": NodeRating(8, 6500.0, "NVIDIA DGX A100 datasheet (2020): 6.5 kW max; read 2026-12-03"),
    "h100": NodeRating(8, 10200.0, "NVIDIA DGX H100 datasheet (2023): ~10.2 kW max; "
                                   "read 2026-12-03"),
    "h200": NodeRating(8, 10200.0, "NVIDIA DGX H200 datasheet (2024): ~10.2 kW max; "
                                   "read 2026-12-03"),
    "b200": NodeRating(8, 14300.0, "NVIDIA DGX B200 user guide, power specifications "
                                   "(2025): 14.3 kW max; read 2026-12-03"),
    "gb200-nvl72": NodeRating(72, 120000.0, "GB200 NVL72 rack ~120 kW (NVIDIA at GTC, "
                                            "2024-03, via ServeTheHome); read 2026-12-03"),
}

# By system family, where the chip has no public TDP but a whole pod's draw is published:
# (chips, watts, source).
POD_RATINGS: dict[str, NodeRating] = {
    "tpu7x": NodeRating(9216, 10e6, "Google at Hot Chips 2025 (2025-08, ServeTheHome's "
                                    "report): a 9,216-chip Ironwood superpod draws about "
                                    "10 MW; read 2026-12-03"),
}

@dataclasses.dataclass(frozen=True)
class Pue:
    """A facility's power over its IT power, what it is in a few words (the report's power
    line) and where the figure comes from."""

    value: float
    label: str
    source: str


# The facility around the IT load where the operator is not known: Uptime Institute Global
# Data Center Survey 2024, the average annual PUE of the data centres surveyed (1.56): the
# GPU systems, which run in anyone's building (a colocation hall, a neocloud's, an owner's).
INDUSTRY_PUE = Pue(1.56, "Uptime Institute's 2024 survey average",
                   "Uptime Institute Global Data Center Survey 2024 (average PUE 1.56)")
# Cloud TPUs run only in Google's data centres, whose fleet-wide figure Google publishes.
GOOGLE_FLEET_PUE = Pue(1.09, "Google's fleet, trailing twelve months",
                       "Google data centers, Efficiency page (google.com/about/"
                       "datacenters/efficiency): fleet-wide trailing twelve-month PUE "
                       "1.09 (2024)")
# By system family, where the operator (and so the building) is known.
FAMILY_PUE: dict[str, Pue] = {
    family: GOOGLE_FLEET_PUE for family in ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu7x")
}


def facility_pue(family: str) -> Pue:
    """The catalog's PUE for a system family: its operator's published fleet figure where
    only one operator runs it (Google's TPUs), else the industry survey's average."""
    return FAMILY_PUE.get(family, INDUSTRY_PUE)


# Electricity billed apart from the chip-hour price. A cloud price already pays for the
# power, so the default is 0; an owner sets usd_per_chip_hour to the amortised hardware and
# this to the tariff (US industrial average about $0.08 per kWh in 2024: EIA Electric
# Power Monthly, table 5.3).
DEFAULT_USD_PER_KWH = 0.0


@dataclasses.dataclass(frozen=True)
class Price:
    usd_per_chip_hour: float
    source: str  # where, and the date the figure was read


# Default price per chip-hour by chip: public list prices only, with where and when. None
# found for the others (B200 and GB200 capacity is quoted per deal; TPU7x, v5e, v5p and
# Trainium2 prices were not in the sources read): those need `[cost] usd_per_chip_hour`.
_AWS_BLOCKS = ("AWS EC2 Capacity Blocks for ML, effective accelerator hourly rate, US East "
               "(rates to 2025-01-01; read 2026-12-03)")
PRICES: dict[str, Price] = {
    "a100": Price(1.844, f"p4d.24xlarge, {_AWS_BLOCKS}"),
    "h100": Price(4.916, f"p5.48xlarge, {_AWS_BLOCKS}"),
    "h200": Price(5.408, f"p5e.48xlarge, {_AWS_BLOCKS}"),
    "tpu-v6e": Price(2.70, "Google Cloud, Trillium GA announcement 2024-12-11: from $2.70 "
                           "per chip-hour on demand (read 2026-12-03)"),
}


# Where each chip's TDP in meshes/chips.py comes from, and when it was read.
TDP_SOURCES: dict[str, str] = {
    "a100": "NVIDIA A100 SXM datasheet (2021): 400 W; read 2026-12-03",
    "h100": "NVIDIA H100 SXM datasheet (2023): 700 W; read 2026-12-03",
    "h200": "NVIDIA H200 SXM datasheet (2024): 700 W; read 2026-12-03",
    "b200": "HGX B200 at 1000 W (glennklockwood.com B200 page, 2025); read 2026-12-03",
    "gb200": "GB200 at 1200 W per Blackwell GPU (glennklockwood.com B200 page, 2025); read "
             "2026-12-03",
    "gb300": "GB300 at 1400 W (verda.com GB300 architecture post, 2025); read 2026-12-03",
    "tpu-v4": "Google Cloud TPU v4 documentation: 192 W maximum; read 2026-12-03",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cost:
    """`[cost]` of a config: None takes the catalog's default for the chip."""

    usd_per_chip_hour: float | None = dataclasses.field(default=None, metadata={
        "help": "what a chip-hour costs, USD (default: the catalog's dated list price, "
                "where one is public)"})
    pue: float | None = dataclasses.field(default=None, metadata={
        "help": "the facility's power over its IT power (default: the operator's published "
                "fleet figure for Google's TPUs, 1.09; Uptime Institute's 2024 average, 1.56, "
                "for the others)"})
    usd_per_kwh: float = dataclasses.field(default=DEFAULT_USD_PER_KWH, metadata={
        "help": "the price of energy, USD per kWh (0: the chip-hour price includes it)"})

    def __post_init__(self):
        # math.isfinite too: an infinite price or PUE printed "inf GW" and "$inf", and wrote
        # Infinity, which is not JSON
        if self.usd_per_chip_hour is not None and not (
                self.usd_per_chip_hour > 0 and math.isfinite(self.usd_per_chip_hour)):
            raise ValueError(f"cost.usd_per_chip_hour={self.usd_per_chip_hour} must be a finite "
                             f"number above 0 (USD per chip and hour); leave it out for the "
                             f"catalog's price")
        if self.pue is not None and not (self.pue >= 1 and math.isfinite(self.pue)):
            raise ValueError(f"cost.pue={self.pue} must be a finite number of at least 1 "
                             f"(facility power over IT power); leave it out for the "
                             f"catalog's ({GOOGLE_FLEET_PUE.value} on TPUs, {INDUSTRY_PUE.value} "
                             f"elsewhere)")
        if not (self.usd_per_kwh >= 0 and math.isfinite(self.usd_per_kwh)):
            raise ValueError(f"cost.usd_per_kwh={self.usd_per_kwh} must be a finite number of 0 "
                             f"or more (0: the chip-hour price includes the power)")


# What an Energy's IT power counts (`Energy.counted`) where it is not the whole node.
CHIPS_ONLY = "chips only (no public rating of the hosts, NICs and switches)"
POD_SHARE = "the whole pod's published draw per chip (chips, hosts, network)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Energy:
    """What one step of a run draws and costs. Per chip figures are averages over the
    step; `power_w` is the facility's draw (IT x PUE) for the run's chips."""

    chips: float
    busy: float  # share of the step the chips' compute streams are occupied
    chip_w: float | None  # per chip, averaged over the step (the whole IT draw for pod
    # ratings); None: no public power figure for the chip (cost only)
    rest_w: float | None  # hosts, NICs, NVLink switches per chip; None: not counted
    pue: float
    step_s: float
    tokens_per_step: float | None
    usd_per_chip_hour: float | None
    usd_per_kwh: float
    counted: str  # what the IT power includes
    sources: tuple[str, ...]
    price_source: str = ""
    pue_label: str = ""  # what `pue` is: the catalog's figure in a few words, or "[cost] pue"

    @property
    def it_w(self) -> float | None:
        if self.chip_w is None:
            return None
        return self.chips * (self.chip_w + (self.rest_w or 0.0))

    @property
    def power_w(self) -> float | None:
        return None if self.it_w is None else self.it_w * self.pue

    @property
    def power_per_chip_w(self) -> float | None:
        return None if self.power_w is None else self.power_w / self.chips

    @property
    def energy_per_step_j(self) -> float | None:
        return None if self.power_w is None else self.power_w * self.step_s

    @property
    def joules_per_token(self) -> float | None:
        if self.energy_per_step_j is None or not self.tokens_per_step:
            return None
        return self.energy_per_step_j / self.tokens_per_step

    @property
    def usd_per_hour(self) -> float | None:
        """Chip-hours plus the power billed apart; None without a price, or when the power
        is billed apart but unknown."""
        if self.usd_per_chip_hour is None:
            return None
        if self.usd_per_kwh and self.power_w is None:
            return None
        power = self.usd_per_kwh * self.power_w / 1e3 if self.usd_per_kwh else 0.0
        return self.usd_per_chip_hour * self.chips + power

    @property
    def usd_per_step(self) -> float | None:
        per_hour = self.usd_per_hour
        return None if per_hour is None else per_hour * self.step_s / 3600

    @property
    def usd_per_million_tokens(self) -> float | None:
        per_hour = self.usd_per_hour
        if per_hour is None or not self.tokens_per_step or self.step_s <= 0:
            return None
        return per_hour * self.step_s / 3600 / self.tokens_per_step * 1e6

    @property
    def tokens_per_s_per_mw(self) -> float | None:
        if not self.tokens_per_step or self.step_s <= 0 or self.power_w is None:
            return None
        return self.tokens_per_step / self.step_s / (self.power_w / 1e6)

    def chips_within(self, budget_w: float, replica_chips: float | None = None) -> int | None:
        """Chips of this system, running this step, that a facility of `budget_w` feeds
        (None without a power figure): whole data-parallel replicas of `replica_chips` (the
        run's chips over its data-parallel ways; the whole run by default), as the step runs
        on no fewer (5 kW fed "3 chips" of an 8-GPU tensor-parallel step, and a run "on more
        data-parallel replicas" was timed on those 3)."""
        if self.power_per_chip_w is None:
            return None
        unit = self.chips if replica_chips is None else replica_chips
        return round(math.floor(budget_w / (self.power_per_chip_w * unit)) * unit)

    def run_of(self, tokens: float, chips: float | None = None) -> dict | None:
        """A run of `tokens` on `chips` of this system (the run's own by default; more
        chips are more data-parallel replicas of this step, at its tokens/s per chip):
        wall time, facility energy and cost. None without tokens per step."""
        if not self.tokens_per_step or self.step_s <= 0:
            return None
        chips = self.chips if chips is None else chips
        per_chip = self.tokens_per_step / self.step_s / self.chips
        seconds = tokens / (per_chip * chips)
        per_chip = self.power_per_chip_w
        energy = None if per_chip is None else per_chip * chips * seconds
        usd = None
        if self.usd_per_chip_hour is not None and (energy is not None or not self.usd_per_kwh):
            usd = (self.usd_per_chip_hour * chips * seconds / 3600
                   + (self.usd_per_kwh * energy / 3.6e6 if self.usd_per_kwh else 0.0))
        return {"tokens": tokens, "chips": chips, "time_s": seconds, "energy_j": energy,
                "usd": usd}

    def scale_out(self, *, power_budget_w: float | None = None,
                  tokens: float | None = None, replica_chips: float | None = None) -> dict:
        """How many chips of this system a facility of `power_budget_w` feeds (whole
        data-parallel replicas of `replica_chips`), and a run of `tokens` on the run's own
        chips and on that many (more or fewer data-parallel replicas of this step at its
        tokens/s per chip: more is a lower bound on time, the larger run's collectives cost
        more)."""
        out: dict = {"power_budget_w": power_budget_w, "tokens": tokens}
        if power_budget_w is not None:
            out["chips_within_budget"] = self.chips_within(power_budget_w, replica_chips)
            out["replica_chips"] = self.chips if replica_chips is None else replica_chips
        if tokens is not None:
            out["run"] = self.run_of(tokens)
            if power_budget_w is not None and out["chips_within_budget"]:
                out["run_within_budget"] = self.run_of(tokens, out["chips_within_budget"])
        return out

    def to_dict(self) -> dict:
        return {
            "power_w": self.power_w, "it_power_w": self.it_w, "chips": self.chips,
            "busy": self.busy, "chip_w": self.chip_w, "rest_w_per_chip": self.rest_w,
            "pue": self.pue, "pue_label": self.pue_label, "counted": self.counted,
            "energy_per_step_j": self.energy_per_step_j,
            "joules_per_token": self.joules_per_token,
            "tokens_per_s_per_mw": self.tokens_per_s_per_mw,
            "usd_per_chip_hour": self.usd_per_chip_hour, "usd_per_kwh": self.usd_per_kwh,
            "usd_per_hour": self.usd_per_hour, "usd_per_step": self.usd_per_step,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "price_source": self.price_source, "sources": list(self.sources),
        }


def replica_chips(num_devices: int, data: int, devices_per_chip: int = 1) -> float:
    """Chips of one data-parallel replica of a run of `num_devices` over `data` ways, whole
    chips (a TPU7x chip's two devices run two replicas of one device)."""
    devices = math.lcm(max(1, num_devices // max(1, data)), devices_per_chip)
    return devices / devices_per_chip


def describe(family: str, chip) -> list[tuple[str, str]]:
    """The catalog's power and price figures for a system family, for `shardscope systems`:
    [("power", ...), ("price", ...)], each with its source."""
    node, pod = NODE_RATINGS.get(family), POD_RATINGS.get(family)
    if chip.tdp_w is not None:
        tdp = chip.tdp_w * chip.devices_per_chip
        power = f"{tdp:g} W TDP per chip [{TDP_SOURCES.get(chip.name, chip.source)}]"
        if node is not None:
            power += f"; {node.rated_w / 1e3:g} kW per {node.chips} chips [{node.source}]"
    elif pod is not None:
        power = f"{pod.rated_w / pod.chips:,.0f} W per chip, whole pod [{pod.source}]"
    else:
        power = "no public figure"
    price = PRICES.get(chip.name)
    return [("power", power),
            ("price", f"${price.usd_per_chip_hour:g} per chip-hour [{price.source}]" if price
             else "no public list price: set [cost] usd_per_chip_hour")]


def estimate(*, family: str, chip, num_devices: int, step_s: float, compute_s: float,
             tokens_per_step: float | None, cost: Cost | None = None) -> Energy | None:
    """The step's power, energy and cost on `num_devices` devices of `chip` in a system of
    `family`; its power figures None where none is public for the chip or its system."""
    cost = cost or Cost()
    chips = num_devices / chip.devices_per_chip
    busy = min(1.0, compute_s / step_s) if step_s > 0 else 0.0
    activity = IDLE_FRACTION + (1 - IDLE_FRACTION) * busy
    price = PRICES.get(chip.name)
    usd = cost.usd_per_chip_hour if cost.usd_per_chip_hour is not None else (
        price.usd_per_chip_hour if price else None)
    price_source = ("[cost] usd_per_chip_hour" if cost.usd_per_chip_hour is not None
                    else price.source if price else "")
    pue = Pue(cost.pue, "from [cost] pue", "[cost] pue") if cost.pue is not None \
        else facility_pue(family)
    common = dict(chips=chips, busy=busy, pue=pue.value, pue_label=pue.label, step_s=step_s,
                  tokens_per_step=tokens_per_step, usd_per_chip_hour=usd,
                  usd_per_kwh=cost.usd_per_kwh, price_source=price_source)
    pue_line = f"PUE {pue.value:g} ({pue.source})"
    idle = (f"a chip waiting draws {IDLE_FRACTION:.0%} of its TDP, running a kernel its "
            f"TDP")
    if chip.tdp_w is not None:
        tdp = chip.tdp_w * chip.devices_per_chip
        node = NODE_RATINGS.get(family)
        sources = [f"{chip.name} TDP {tdp:g} W ({TDP_SOURCES.get(chip.name, chip.source)})",
                   idle]
        rest = None
        counted = CHIPS_ONLY
        if node is not None:
            rest = (node.rated_w - node.chips * tdp) / node.chips * REST_SHARE
            counted = "chips, hosts, NICs and NVLink switches; not scale-out switches"
            sources.append(f"the rest of the node: {node.source}, less its chips' TDP, at "
                           f"{REST_SHARE:.0%} under training (arXiv:2412.08602)")
        return Energy(chip_w=tdp * activity, rest_w=rest, counted=counted,
                      sources=(*sources, pue_line), **common)
    pod = POD_RATINGS.get(family)
    if pod is None:
        return Energy(chip_w=None, rest_w=None, counted="no public power figure",
                      sources=(), **common)
    return Energy(chip_w=pod.rated_w / pod.chips * activity, rest_w=None,
                  counted=POD_SHARE,
                  sources=(pod.source, f"a chip waiting draws {IDLE_FRACTION:.0%} of its "
                           f"share of the pod's draw, running a kernel all of it", pue_line),
                  **common)
