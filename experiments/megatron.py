"""`shardscope import megatron`: Megatron-LM's command-line flags as an experiment config.

The input is what a user has: a list of flags (one or several per line, `#` comments, as
`shardscope export --to megatron` writes it) or a launch script (`torchrun ... pretrain_gpt.py
--flag value \\` lines, with the shell variables and arrays the script assigns, e.g. `TP=4`
used as `$TP`, or Megatron's examples' `GPT_MODEL_ARGS=( ... )` used as `${GPT_MODEL_ARGS[@]}`).

Each flag shardscope models is translated, with Megatron's own defaults (its arguments.py)
for those left out; a flag that changes what runs and has no shardscope equivalent is refused
by name; every other flag read is listed in the written file as read but not modelled. The
data-parallel size is what the system's devices leave, as Megatron implies it.

What the flags cannot say (shardscope's FSDP axis, its rule preset, a custom remat, ...) the
export writes as `# shardscope set: table.key=value` lines (frameworks.py), which the
import applies as `--set` would: export then import gives the experiment back.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import shlex
from pathlib import Path

from experiments import config as config_mod
from experiments.config import ConfigError
from experiments.frameworks import SET_LINE, SYSTEM_LINE
from experiments.importer import system_of, to_toml
from models.pipeline import Pipeline
from sharding.rules import divisors

_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?:\[[@*]\])?(?::?-([^}]*))?\}|([A-Za-z_]\w*))")
_ASSIGN = re.compile(r"\s*(?:export\s+|local\s+|readonly\s+|declare\s+(?:-\w+\s+)*)?"
                     r"([A-Za-z_]\w*)=(.*)$", re.S)


@dataclasses.dataclass(frozen=True)
class Unresolved:
    """A word of the script that names a variable the script does not assign."""

    text: str
    variable: str


# ---- the file: flags, variables, the lines shardscope writes -------------------------------

def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with their `\\` continuations joined, and an array assignment's `( ... )` over
    several lines as one; each with its first line's number."""
    out, buf, code, start = [], "", "", 0  # code: buf without its comments
    for number, line in enumerate(text.splitlines(), 1):
        if not buf:
            start = number
        stripped = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            code += stripped[:-1] + " "
            continue
        buf += line
        code += stripped
        # a bracket in a comment does not open or close the array
        if _ASSIGN.match(code) and "=(" in code and code.count("(") > code.count(")"):
            buf += "\n"
            code += "\n"
            continue
        out.append((start, buf))
        buf = code = ""
    if buf:
        out.append((start, buf))
    return out


def _expand(word: str, env: dict[str, list[str]]) -> list[str | Unresolved]:
    """A word with its variables replaced: a word that is one variable becomes its words (an
    array's items, a string's words), as the shell splits them unquoted."""
    whole = _VAR.fullmatch(word)
    name = whole and (whole.group(1) or whole.group(3))
    if whole and name in env:
        return list(env[name])
    if "$(" in word:  # command or arithmetic substitution: not run here
        return [Unresolved(word, word[word.index("$("):].split()[0])]
    missing = []

    def value(m: re.Match) -> str:
        var, default = m.group(1) or m.group(3), m.group(2)
        if var in env:
            return " ".join(env[var])
        if default is not None:
            return default
        missing.append(var)
        return m.group(0)

    text = _VAR.sub(value, word)
    return [Unresolved(word, missing[0])] if missing else [text]


def _words(text: str, number: int) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError as e:
        raise ConfigError(f"line {number}: {text.strip()[:60]!r}: {e} (an unclosed quote?); "
                          f"fix the line") from None


def read_script(text: str) -> tuple[list[str | Unresolved], str, list[str]]:
    """The words that are Megatron's arguments, the system a `# shardscope system:` line
    names ("" if none) and the `# shardscope set:` overrides.

    In a script that runs a `*.py` program, its arguments are the words after it; otherwise
    every word outside variable assignments is."""
    system, sets, env = "", [], {}
    loose, program = [], None
    for number, line in _logical_lines(text):
        if line.startswith(SYSTEM_LINE):
            system = line[len(SYSTEM_LINE):].strip()
        elif line.startswith(SET_LINE):
            sets.append(line[len(SET_LINE):].strip())
        assign = _ASSIGN.match(line)
        if assign and not line.lstrip().startswith("-"):
            name, value = assign.groups()
            value = value.strip()
            array = value.startswith("(")
            words = _words(value[1:value.rindex(")")] if array and ")" in value else value,
                           number)
            got = [w for word in words for w in _expand(word, env)]
            bad = [w for w in got if isinstance(w, Unresolved)]
            if not bad:
                env[name] = got if array else " ".join(got).split()
            continue
        words = [w for word in _words(line, number) for w in _expand(word, env)]
        names = [Path(getattr(w, "text", w)).name for w in words]
        runs = [i for i, n in enumerate(names) if n.endswith(".py")]
        # the training program (pretrain_gpt.py) rather than a tool the script runs first
        if runs and (program is None or names[runs[0]].startswith("pretrain")):
            program = words[runs[0] + 1:]
        elif not runs:
            loose += words
    return (loose if program is None else program), system, sets


def parse_flags(words: list[str | Unresolved], where: str) -> dict[str, list]:
    """`--name value ...` words as {name: values} (no values: a switch); a later flag wins,
    as in Megatron's argparse. Names use dashes (`--a_b` is `--a-b`)."""
    flags, name = {}, None
    for w in words:
        if isinstance(w, str) and w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            name = name.replace("_", "-")
            flags[name] = [value] if eq else []
        elif name is None:
            shown = w.text if isinstance(w, Unresolved) else w
            raise ConfigError(f"{where}: {shown!r} is not a Megatron flag (--name value); give "
                              f"the flags one after another, e.g. --tensor-model-parallel-size "
                              f"4, or the launch script that runs pretrain_gpt.py")
        else:
            flags[name].append(w)
    return flags


def with_overrides(flags: dict[str, list], overrides: list[str]) -> dict[str, list]:
    """The file's flags with the command line's overrides: `--flag value`, `--flag=value` or
    `KEY=VALUE` (`KEY` a flag's name without its dashes, `-` or `_`; `KEY=true` turns a switch
    on, `KEY=false` off)."""
    words, off = [], []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or item.startswith("-"):
            words.append(item)
        elif value.lower() == "false":
            off.append(key.strip().lstrip("-").replace("_", "-"))
        else:
            words += [f"--{key.strip()}", *([] if value.lower() == "true" else [value])]
    out = {**flags, **parse_flags(words, "override")}
    for name in off:
        out.pop(name, None)
    return out


class Flags:
    """Megatron's flags as read, and which of them the translation has used."""

    def __init__(self, values: dict[str, list]):
        self.values, self.used = values, set()
        # every flag the translation looked for, given or not: a flag close to one of these
        # is a misspelling
        self.asked: set[str] = set()
        self.notes: list[str] = []  # how a flag read is modelled, where not as Megatron runs

    def given(self, name: str) -> bool:
        self.asked.add(name)
        return name in self.values

    def values_text(self, name: str) -> str | None:
        """The flag's values as one text (a pattern the shell split); marks it used."""
        if not self.given(name):
            return None
        if len(self.values[name]) > 1:
            self.values[name] = [" ".join(str(getattr(w, "text", w))
                                          for w in self.values[name])]
        return self.text(name)

    def text(self, name: str) -> str | None:
        """The flag's one value (None when absent); marks it used."""
        if not self.given(name):
            return None
        self.used.add(name)
        got = self.values[name]
        if len(got) != 1:
            shown = " ".join(w.text if isinstance(w, Unresolved) else w for w in got)
            raise ConfigError(f"--{name} {shown}".rstrip() + f": takes one value, got "
                              f"{len(got)}; give it as --{name} VALUE")
        if isinstance(got[0], Unresolved):
            v = got[0]
            raise ConfigError(f"--{name} {v.text}: {v.variable} is not assigned in the file "
                              f"(an environment variable or a command's output); assign it "
                              f"there or give the flag as an override, {name}=VALUE")
        return got[0]

    def switch(self, name: str) -> bool:
        if not self.given(name):
            return False
        self.used.add(name)
        got = self.values[name]
        if got and all(isinstance(w, Unresolved) for w in got):
            # words of a variable the file does not assign (e.g. $EXTRA_ARGS), not its value
            self.notes.append(f"{' '.join(w.text for w in got)} after --{name}: not assigned "
                              f"in the file, so the flags it holds are not read; give them "
                              f"as overrides")
            return True
        if got:
            raise ConfigError(f"--{name} is a switch and takes no value, got "
                              f"{self.values[name][0]!r}; write --{name} alone")
        return True

    def int(self, name: str, default: int | None = None, minimum: int = 1,
            example: int | None = None) -> int | None:
        """The flag's whole number, at least `minimum` (`default` when absent); `example`: a
        value a mistake's message shows (else the default, or `minimum`)."""
        def whole(v: str) -> int:
            try:
                out = int(v)
            except ValueError:
                raise ValueError("a whole number") from None
            if out < minimum:
                raise ValueError(f"at least {minimum}")
            return out

        return self._number(name, default, whole,
                            example if example is not None else max(minimum, default or 1))

    def float(self, name: str, default: float | None = None,
              example: float | None = None) -> float | None:
        """The flag's finite number (`default` when absent); `example`: as `int`'s."""
        def finite(v: str) -> float:
            try:
                out = float(v)
            except ValueError:
                out = math.nan
            if not math.isfinite(out):  # float() reads "nan" and "inf" too
                raise ValueError("a finite number")
            return out

        shown = example if example is not None else default if default is not None else 1.0
        return self._number(name, default, finite, shown)

    def _number(self, name: str, default, read, example):
        """The flag's value as `read` makes it, `default` when absent; `read` raises
        ValueError saying what is valid, which a one-line error shows with `example`."""
        v = self.text(name)
        if v is None:
            return default
        try:
            return read(v)
        except ValueError as e:
            raise ConfigError(f"--{name} {v}: must be {e}, e.g. --{name} {example}") from None

    def choice(self, name: str, default: str | None, choices, hint: str = "") -> str | None:
        v = self.text(name)
        if v is not None and v not in choices:
            raise ConfigError(f"--{name} {v}: valid: {', '.join(choices)}{hint}")
        return default if v is None else v

    def unused(self) -> list[str]:
        return [n for n in self.values if n not in self.used]


# Flags that change what runs and that shardscope cannot represent: the reason and the fix.
REFUSED = {
    "fp16": "shardscope trains in bf16 or fp32 (no fp16 with loss scaling); use --bf16",
    "squared-relu": "shardscope's MLPs are SwiGLU (--swiglu), GeLU (Megatron's default) "
                    "and ReLU; drop it for the nearest, GeLU",
    "pipeline-model-parallel-layout": "shardscope lays the layers over the stages evenly "
                                      "(padding at the ends); use --decoder-first-pipeline-"
                                      "num-layers / --decoder-last-pipeline-num-layers or "
                                      "--account-for-embedding-in-pipeline-split",
    "hierarchical-context-parallel-sizes": "shardscope's context parallelism is one ring or "
                                           "all-gather (--cp-comm-type p2p or all_gather)",
    "rampup-batch-size": "shardscope models one global batch per step; drop it to model the "
                         "final --global-batch-size",
    "mtp-num-layers": "shardscope models no multi-token-prediction layers; drop it (their "
                      "cost is about one more layer each)",
    "window-size": "shardscope's attention is causal over the whole sequence (no sliding "
                   "window); drop it for the full attention's cost",
    "moe-extended-tp": "shardscope splits experts over the expert axis and their MLP over "
                       "tensor; drop it and set --expert-model-parallel-size",
}
# Megatron's older names of a flag read here: (the flag, the value the old one means)
ALIASES = {"encoder-num-layers": ("num-layers", None), "encoder-seq-length": ("seq-length", None),
           "use-rotary-position-embeddings": ("position-embedding-type", "rope"),
           "recompute-activations": ("recompute-granularity", "selective"),
           "use-custom-fsdp": ("use-megatron-fsdp", ""), "use-torch-fsdp2":
           ("use-megatron-fsdp", "")}


# ---- the translation ----------------------------------------------------------------------

def _renamed(values: dict[str, list]) -> dict[str, list]:
    """Refused flags raise; Megatron's older names become the flags read here."""
    for name in values:
        if name in REFUSED:
            raise ConfigError(f"--{name}: {REFUSED[name]}")
    out = dict(values)
    for old, (new, means) in ALIASES.items():
        if old in out:
            words = out.pop(old)
            out.setdefault(new, words if means is None else [means] if means else [])
    return out


def _parallelism(f: Flags, n: int, system: str) -> tuple[dict, int]:
    """[parallelism] and Megatron's data-parallel size (what the devices leave)."""
    t, p = f.int("tensor-model-parallel-size", 1), f.int("pipeline-model-parallel-size", 1)
    c, e = f.int("context-parallel-size", 1), f.int("expert-model-parallel-size", 1)
    if n % (t * p * c):
        resized = _resized_flag({"tensor": t, "pipeline": p, "context": c}, n)
        raise ConfigError(f"--tensor-model-parallel-size {t} x --pipeline-model-parallel-size "
                          f"{p} x --context-parallel-size {c} = {t * p * c} does not divide "
                          f"the {n} devices of {system} (Megatron refuses it too); make the "
                          f"product a divisor of {n} (the data-parallel size is the rest: "
                          f"{n} / product){resized}, or give another --system")
    dp = n // (t * p * c)
    etp = f.int("expert-tensor-parallel-size", t)
    if etp != t:
        raise ConfigError(f"--expert-tensor-parallel-size {etp}: shardscope splits the experts' "
                          f"MLP over tensor as the dense MLP's (--tensor-model-parallel-size "
                          f"{t}); set it to {t} or drop it")
    if dp % e:
        raise ConfigError(f"--expert-model-parallel-size {e} does not divide the data-parallel "
                          f"size {dp} (= {n} devices / {t * p * c}): shardscope's expert ranks "
                          f"are data-parallel ones; choose one of "
                          f"{divisors(dp)}")
    if f.int("num-distributed-optimizer-instances", 1) != 1:
        raise ConfigError("--num-distributed-optimizer-instances: shardscope shards the "
                          "optimizer over every data-parallel rank; set it to 1")
    mode = f.choice("cp-comm-type", "p2p", ("p2p", "all_gather", "a2a", "a2a+p2p"))
    if mode.startswith("a2a"):
        raise ConfigError(f"--cp-comm-type {mode}: shardscope models p2p (K/V passed around a "
                          f"ring) and all_gather context parallelism; use one of them")
    replicas = "fsdp" if f.switch("use-megatron-fsdp") else "data"
    par = {"pipeline": p, replicas: dp // e, "expert": e, "sequence": c, "tensor": t}
    par = {k: v for k, v in par.items() if v > 1}
    if c > 1:
        par["context_mode"] = "ring" if mode == "p2p" else "allgather"
    for flag, key in (("sequence-parallel", "sequence_parallel"),
                      ("tp-comm-overlap", "tp_comm_overlap")):
        if f.switch(flag):
            par[key] = True
    f.switch("overlap-p2p-communication")  # Megatron's default (older versions' switch)
    if f.switch("no-overlap-p2p-communication"):
        par["overlap_p2p_comm"] = False
    return par, dp


def _resized_flag(sizes: dict[str, int], n: int) -> str:
    """", e.g. --pipeline-model-parallel-size 2 or 4": the sizes that divide `n` with the
    other flags kept, for the flag whose own size does not divide it (else the largest)."""
    bad = [k for k, v in sizes.items() if n % v] or list(sizes)
    name = max(bad, key=lambda k: sizes[k])
    rest = math.prod(v for k, v in sizes.items() if k != name)
    valid = [v for v in range(1, n + 1) if n % (v * rest) == 0]
    if not valid:
        return ""
    lower = [v for v in valid if v < sizes[name]][-1:]
    upper = [v for v in valid if v > sizes[name]][:1]
    flag = f"--{name}{'-model' if name != 'context' else ''}-parallel-size"
    return f", e.g. {flag} {' or '.join(map(str, lower + upper))}"


def _stage_layers(f: Flags, layers: int, stages: int) -> tuple[int, list[list[int]], str]:
    """The virtual stages and the layers of each stage's chunks as Megatron lays them, and
    the flags that said so."""
    embed = f.switch("account-for-embedding-in-pipeline-split")
    loss = f.switch("account-for-loss-in-pipeline-split")
    first = f.int("decoder-first-pipeline-num-layers", minimum=0)
    last = f.int("decoder-last-pipeline-num-layers", minimum=0)
    chunk = f.int("num-layers-per-virtual-pipeline-stage")
    vpp = f.int("virtual-pipeline-model-parallel-size")
    if chunk and vpp:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-"
                          "model-parallel-size both given (Megatron refuses it too); keep one")
    uneven = first is not None or last is not None
    if uneven and (embed or loss):
        raise ConfigError("--decoder-first/last-pipeline-num-layers with --account-for-*-in-"
                          "pipeline-split (Megatron refuses both); keep one way")
    if uneven and (chunk or (vpp or 1) > 1):
        raise ConfigError("--decoder-first/last-pipeline-num-layers with virtual stages: "
                          "shardscope pads an interleaved pipeline at the model's ends only; "
                          "use --account-for-embedding-in-pipeline-split / --account-for-"
                          "loss-in-pipeline-split instead")
    if uneven:
        ends = (first or 0) + (last or 0)
        middle = stages - (first is not None) - (last is not None)
        if layers < ends or (middle and (layers - ends) % middle) or (
                not middle and layers != ends):
            raise ConfigError(f"--num-layers {layers} less --decoder-first/last-pipeline-num-"
                              f"layers ({ends}) does not split evenly over the {middle} other "
                              f"stages (Megatron refuses it too); change one of them")
        each = (layers - ends) // middle if middle else 0
        counts = [each] * stages
        counts[0] = counts[0] if first is None else first
        counts[-1] = counts[-1] if last is None else last
        return 1, [[k] for k in counts], "--decoder-first/last-pipeline-num-layers"
    slots, how = layers + embed + loss, "--num-layers"
    if embed or loss:
        how = f"--num-layers {layers} + {embed + loss} (--account-for-*-in-pipeline-split)"
    per_stage = slots / stages
    if vpp:
        virtual = vpp
    elif chunk:
        virtual = per_stage / chunk
    else:
        virtual = 1
    if not float(per_stage / virtual).is_integer() or not float(virtual).is_integer():
        what = (f"--num-layers-per-virtual-pipeline-stage {chunk}" if chunk else
                f"--virtual-pipeline-model-parallel-size {vpp}" if vpp else "")
        raise ConfigError(f"{how} = {slots} layers do not split evenly over "
                          f"--pipeline-model-parallel-size {stages}" + (f" x {what}" if what
                                                                          else "")
                          + " (Megatron refuses it too); use --decoder-first/last-pipeline-"
                            "num-layers or --account-for-embedding-in-pipeline-split, or "
                            "another pipeline size")
    virtual, size = int(virtual), slots // (stages * int(virtual))
    counts = [[len(set(range((v * stages + s) * size, (v * stages + s + 1) * size))
                   & set(range(embed, embed + layers))) for v in range(virtual)]
              for s in range(stages)]
    return virtual, counts, how


def _pipeline(f: Flags, layers: int, stages: int, microbatches: int) -> int:
    """parallelism.virtual_stages, where shardscope lays the layers as Megatron does."""
    if stages == 1:  # virtual stages without pipeline stages: Megatron refuses them
        chunk = f.int("num-layers-per-virtual-pipeline-stage")
        vpp = f.int("virtual-pipeline-model-parallel-size", 1)
        if chunk or vpp > 1:
            given = (f"--num-layers-per-virtual-pipeline-stage {chunk}" if chunk else
                     f"--virtual-pipeline-model-parallel-size {vpp}")
            raise ConfigError(f"{given}: virtual stages need pipeline stages (Megatron "
                              f"refuses it too); add --pipeline-model-parallel-size 2 or "
                              f"more, or drop it")
        return 1
    virtual, theirs, how = _stage_layers(f, layers, stages)
    plan = Pipeline(stages=stages, microbatches=max(microbatches, stages), layers=layers,
                    virtual=virtual)
    ours = [[sum(chunk) for chunk in chunks] for chunks in plan.valid_mask()]
    if ours != theirs:
        front, back = plan.padding
        fix = (f"--decoder-first-pipeline-num-layers {ours[0][0]} --decoder-last-pipeline-"
               f"num-layers {ours[-1][-1]}" if virtual == 1 else
               "--account-for-embedding-in-pipeline-split" + (
                   " --account-for-loss-in-pipeline-split" if back else "")
               if (front, back) in ((1, 1), (1, 0)) else "a pipeline size that divides "
               "--num-layers")
        raise ConfigError(f"{how} over {stages} stages lays {[sum(c) for c in theirs]} layers "
                          f"per stage; shardscope pads {front} empty slot(s) before the first "
                          f"layer and {back} after the last, {[sum(c) for c in ours]}: use "
                          f"{fix}")
    return virtual


def _required(f: Flags, name: str, example: int) -> int:
    v = f.int(name, example=example)
    if v is None:
        raise ConfigError(f"no --{name}: shardscope needs it (Megatron's has no default "
                          f"here); add --{name} {example}, or the override {name}={example}")
    return v


def _moe_layers(f: Flags, layers: int) -> int:
    """The dense first layers --moe-layer-freq leaves (shardscope's MoE layers are all the
    others)."""
    freq = f.values_text("moe-layer-freq")
    if freq is None or freq.strip() == "1":
        return 0
    try:  # Megatron's pattern: a Python list expression, e.g. ([0]*3+[1]*58)
        pattern = _list_expression(freq)
    except ValueError:
        pattern = None
    if pattern is None or len(pattern) != layers or set(pattern) - {0, 1}:
        raise ConfigError(f"--moe-layer-freq {freq}: give one 0 (dense) or 1 (MoE) per layer "
                          f"({layers}), e.g. '([0]*3+[1]*{max(layers - 3, 1)})'")
    dense = pattern.index(1) if 1 in pattern else layers
    if any(x == 0 for x in pattern[dense:]):
        raise ConfigError(f"--moe-layer-freq {freq}: shardscope's dense layers are the first "
                          f"ones (DeepSeek's first_k_dense_replace), then every layer MoE; "
                          f"use '([0]*{dense}+[1]*{layers - dense})'")
    return dense


def _list_expression(text: str) -> list[int]:
    """`[0]*3+[1]*2`, `([0,1]*2)` or `[0,0,1]`: Megatron's --moe-layer-freq list, read
    without eval."""
    out = []
    for term in text.strip().strip("()").replace(" ", "").split("+"):
        items, star, times = term.partition("*")
        if not (items.startswith("[") and items.endswith("]")):
            raise ValueError(term)
        values = [int(x) for x in items[1:-1].split(",") if x]
        out += values * (int(times) if star else 1)
    return out


def _model(f: Flags) -> dict:
    layers = _required(f, "num-layers", 32)
    d = _required(f, "hidden-size", 4096)
    heads = _required(f, "num-attention-heads", 32)
    swiglu = f.switch("swiglu")
    # arguments.py's default: 4 h, or 2/3 of it for SwiGLU rounded down to 64
    ffn = f.int("ffn-hidden-size", int(4 * d * 2 / 3 / 64) * 64 if swiglu else 4 * d)
    if d % heads and not f.given("kv-channels"):
        raise ConfigError(f"--hidden-size {d} is not a multiple of --num-attention-heads "
                          f"{heads}; give --kv-channels (each head's width)")
    head_dim = f.int("kv-channels", d // heads)
    groups = f.int("num-query-groups", 1) if f.switch("group-query-attention") else heads
    vocab = f.int("vocab-size", example=50257)  # GPT-2's
    if vocab is None:
        raise ConfigError("no --vocab-size: Megatron takes it from the tokenizer (--tokenizer-"
                          "type, --vocab-file), which shardscope does not read; add "
                          "--vocab-size N, e.g. vocab-size=50257 for GPT-2's")
    norm = f.choice("normalization", "LayerNorm", ("LayerNorm", "RMSNorm"))
    positions = f.choice("position-embedding-type", "learned_absolute",
                         ("rope", "learned_absolute"),
                         "; shardscope models RoPE and a learned table")
    model = {"n_layers": layers, "d_model": d, "n_heads": heads, "n_kv_heads": groups,
             "head_dim": head_dim, "d_ff": ffn, "vocab": vocab,
             "vocab_multiple": f.int("make-vocab-size-divisible-by", 128),
             "mlp": "swiglu" if swiglu else "gelu",
             "norm": "rmsnorm" if norm == "RMSNorm" else "layernorm",
             "positions": "rope" if positions == "rope" else "learned",
             "tie_embeddings": not f.switch("untie-embeddings-and-output-weights"),
             # Megatron fuses q, k, v (linear_qkv) and SwiGLU's gate and up (linear_fc1)
             "fused_qkv": True, "fused_mlp": swiglu}
    max_positions = f.int("max-position-embeddings", example=4096)
    if positions == "rope":
        model["rope_theta"] = f.float("rotary-base", 10000.0)
    elif max_positions:
        model["max_seq_len"] = max_positions
    if f.choice("attention-backend", "auto", ("auto", "flash", "fused", "unfused", "local")) \
            in ("unfused", "local"):
        model["attention"] = "dense"  # the scores materialised
    model.update(_experts(f, layers, ffn))
    if f.switch("multi-latent-attention"):
        qk = f.int("qk-head-dim", 128)
        v = f.int("v-head-dim", 128)
        model.update(n_kv_heads=heads, head_dim=qk, kv_lora_rank=f.int("kv-lora-rank", 32),
                     q_lora_rank=f.int("q-lora-rank", 0, minimum=0),
                     qk_rope_dim=f.int("qk-pos-emb-head-dim", 64), v_head_dim=v)
    return model


def _experts(f: Flags, layers: int, ffn: int) -> dict:
    experts = f.int("num-experts")
    if not experts or experts == 1:
        return {}
    expert_ffn = f.int("moe-ffn-hidden-size", ffn)
    out = {"n_experts": experts, "experts_per_token": f.int("moe-router-topk", 2),
           "d_ff": expert_ffn}
    shared = f.int("moe-shared-expert-intermediate-size", 0, minimum=0)
    if shared % expert_ffn:
        raise ConfigError(f"--moe-shared-expert-intermediate-size {shared}: shardscope's shared "
                          f"experts are whole experts of --moe-ffn-hidden-size {expert_ffn}; "
                          f"use a multiple of it")
    if shared:
        out["n_shared_experts"] = shared // expert_ffn
    dense = _moe_layers(f, layers)
    if dense:
        out["n_dense_layers"] = dense
        if ffn != expert_ffn:
            out["dense_d_ff"] = ffn
    factor = f.float("moe-expert-capacity-factor")
    if factor is None:
        out["dropless"] = True
    else:
        out["capacity_factor"] = factor
        if not f.switch("moe-pad-expert-input-to-capacity"):
            f.notes.append(f"--moe-expert-capacity-factor {factor:g} without --moe-pad-expert-"
                           f"input-to-capacity: shardscope computes every expert's slots, "
                           f"full or not (an upper bound of Megatron's work)")
    return out


def _precision(f: Flags) -> dict:
    bf16 = f.switch("bf16")
    fp8 = f.choice("fp8-format", None, ("e4m3", "hybrid"))
    fp4 = f.choice("fp4-format", None, ("e2m1",))
    if (fp8 or fp4) and not bf16:
        raise ConfigError(f"--{'fp8' if fp8 else 'fp4'}-format without --bf16: shardscope's "
                          f"low-precision matmuls keep bf16 between them; add --bf16")
    if fp8 and fp4:
        raise ConfigError("--fp8-format and --fp4-format both given; keep one")
    for flag, valid in (("fp8-recipe", ("delayed", "tensorwise", "mxfp8", "blockwise")),
                        ("fp4-recipe", ("nvfp4",))):
        recipe = f.choice(flag, None, valid)
        if recipe:
            f.notes.append(f"--{flag} {recipe}: shardscope's low-precision matmuls count bytes "
                           f"and FLOPs, not the recipe's scaling")
    # --bf16: bf16 weights with an fp32 copy in the optimizer (Megatron's Float16Module)
    out = {"params": "bfloat16", "master_weights": "float32"} if bf16 else \
        {"params": "float32"}
    out["compute"] = "float8" if fp8 else "float4" if fp4 else "bfloat16" if bf16 else "float32"
    if f.switch("grad-reduce-in-bf16"):
        out["grad_reduce"] = "bfloat16"
    f.switch("accumulate-allreduce-grads-in-fp32")  # what shardscope does by default
    return out


def _remat(f: Flags, layers_per_stage: int) -> dict:
    granularity = f.choice("recompute-granularity", None, ("full", "selective"))
    method = f.choice("recompute-method", None, ("uniform", "block"))
    k = f.int("recompute-num-layers", 1, minimum=0)
    if granularity is None:
        return {"remat": "none"}
    if granularity == "selective":  # the attention core recomputed, the matmuls' kept
        return {"remat": "minimal"}
    if method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or "
                          "block (Megatron asks too); add --recompute-method uniform "
                          "--recompute-num-layers 1")
    if (method, k) == ("uniform", 1) or (method == "block" and k >= layers_per_stage):
        return {"remat": "full"}
    if method == "block" and k == 0:
        return {"remat": "none"}
    raise ConfigError(f"--recompute-method {method} --recompute-num-layers {k}: shardscope "
                      f"recomputes every layer alike (its input kept, or all kept); use "
                      f"--recompute-method uniform --recompute-num-layers 1 (remat full) or "
                      f"drop --recompute-granularity (none)")


def _train(f: Flags, layers_per_stage: int) -> dict:
    optimizer = f.choice("optimizer", "adam", ("adam", "sgd"))
    if optimizer != "adam":
        raise ConfigError(f"--optimizer {optimizer}: shardscope models Adam(W)'s state; use "
                          f"--optimizer adam")
    out = {**_remat(f, layers_per_stage),
           "shard_optimizer_over_data": f.switch("use-distributed-optimizer"),
           "overlap_grad_reduce": f.switch("overlap-grad-reduce"),
           "overlap_param_gather": f.switch("overlap-param-gather"),
           "bucket_size": f.int("ddp-bucket-size", 0, minimum=0),
           "weight_decay": f.float("weight-decay", 0.01)}  # Megatron's default
    lr = f.float("lr", example=3e-4)  # Llama 2 7B's peak (arXiv:2307.09288)
    if lr is not None:
        out["learning_rate"] = lr
    return out


def translate(values: dict[str, list], system_name: str, name: str) -> tuple[dict, Flags]:
    """The experiment's tables (as a TOML file holds them), not yet validated, and the flags
    with what the translation used and noted."""
    f = Flags(_renamed(values))
    system, overrides = system_of(system_name)
    par, dp = _parallelism(f, system.num_devices, system.name)
    model = _model(f)
    mb = f.int("micro-batch-size", 1)
    gb = f.int("global-batch-size", mb * dp)
    if gb % (mb * dp):
        raise ConfigError(f"--global-batch-size {gb} is not a multiple of --micro-batch-size "
                          f"{mb} x the data-parallel size {dp} (Megatron refuses it too); use "
                          f"a multiple of {mb * dp}")
    microbatches = gb // (mb * dp)
    stages = par.get("pipeline", 1)
    virtual = _pipeline(f, model["n_layers"], stages, microbatches)
    if virtual > 1:
        par["virtual_stages"] = virtual
    seq = _required(f, "seq-length", 4096)
    if not f.switch("disable-bias-linear"):
        f.notes.append("no --disable-bias-linear: Megatron's linear layers carry biases, "
                       "shardscope's none (a few MB of parameters)")
    raw = {"name": name, "model": model, "system": {"name": system.name, **overrides},
           "parallelism": par,
           "workload": {"seq_len": seq, "global_batch": gb, "microbatches": microbatches},
           "precision": _precision(f),
           "train": _train(f, -(-model["n_layers"] // (stages * virtual)))}
    return raw, f


def read_megatron(path: str | Path, overrides: list[str] = ()) -> tuple[dict, str, list[str]]:
    """The flags of a file (and the overrides after them), the system its `# shardscope
    system:` line names ("" if none) and its `# shardscope set:` lines."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Megatron flags file {str(path)!r} not found; give the flags (one "
                          f"or several per line) or the launch script that runs "
                          f"pretrain_gpt.py, e.g. one written by `shardscope export CONFIG "
                          f"--to megatron --out X.sh`")
    words, system, sets = read_script(p.read_text())
    values = parse_flags(words, str(path))
    if not values:
        raise ConfigError(f"{path}: no Megatron flags (--name value) found; give the flags, or "
                          f"the launch script with its pretrain_gpt.py line")
    return with_overrides(values, overrides), system, sets


def apply_sets(raw: dict, sets: list[str], where: str) -> None:
    """The `# shardscope set: table.key=value` lines, as `--set` applies them; but
    `parallelism.fsdp=K` makes K of the data-parallel ranks the flags give FSDP ones, so that
    it still holds when the flags change the data-parallel size."""
    for item in sets:
        key, _, value = item.partition("=")
        par = raw["parallelism"]
        if key.strip() == "parallelism.fsdp" and value.strip().isdigit():
            fsdp, data = int(value), par.get("data", 1)
            if data % fsdp:
                raise ConfigError(f"{where}: {SET_LINE}{item}: {fsdp} FSDP ranks do not divide "
                                  f"the data-parallel size {data} the flags give; edit or "
                                  f"delete the line")
            par.update(data=data // fsdp, fsdp=fsdp)
            continue
        try:
            config_mod.apply_override(raw, item)
        except ConfigError as e:
            raise ConfigError(f"{where}: {SET_LINE}{item}: {e}") from None


# Megatron's own flags that are one letter or word from a flag read here (not misspellings)
NEAR_READ = frozenset({"decoder-seq-length", "encoder-tensor-model-parallel-size",
                       "encoder-pipeline-model-parallel-size"})


def _misspelt(f: Flags) -> None:
    """Refuses a flag given but not read that is one letter from a flag the translation
    looked for (or one of its older names)."""
    read = f.asked | ALIASES.keys()
    for name in f.unused():
        near = difflib.get_close_matches(name, read, n=1, cutoff=0.85)
        if near and name not in read | NEAR_READ:
            raise ConfigError(f"--{name}: not a Megatron flag shardscope reads; did you mean "
                              f"--{near[0]}?")


def experiment(path: str | Path, overrides: list[str], system: str | None, name: str
               ) -> tuple[dict, list[str]]:
    """The checked experiment tables of a Megatron flags file, and the notes for its TOML:
    the flags read but not modelled, and how some are modelled."""
    values, named, sets = read_megatron(path, overrides)
    system = system or named
    if not system:
        raise ConfigError(f"{path}: Megatron's flags do not say which machine they run on; "
                          f"give --system NAME (e.g. --system h100:64; `shardscope systems` "
                          f"lists them)")
    raw, f = translate(values, system, name)
    _misspelt(f)
    apply_sets(raw, sets, str(path))
    try:
        config_mod.from_dict(raw)  # its checks, naming the config's keys
    except ConfigError as e:
        if not sets:
            raise
        raise ConfigError(f"{e} (with the file's `{SET_LINE.strip()}` lines applied: edit or "
                          f"delete those that no longer fit the flags)") from None
    notes = list(f.notes)
    if f.unused():
        notes.append("Megatron flags read but not modelled: "
                     + ", ".join(f"--{n}" for n in f.unused()))
    return raw, notes


def import_megatron(path: str, overrides: list[str], system: str | None, out: str) -> str:
    """The experiment TOML of Megatron-LM flags; `system` unless the file names one."""
    raw, notes = experiment(path, overrides, system, Path(out).stem)
    return to_toml(raw, Path(path).name, what="the Megatron-LM flags", framework="megatron",
                   notes=notes)
