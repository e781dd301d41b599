"""Accelerator descriptions for the planner, each number with its source ("datasheet", "measured",
"assumed"). Collectives: NCCL's latency + wire bytes / bus bandwidth, or a measured curve (log-log
interpolated)."""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
from typing import Mapping, Optional, Sequence

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CALIBRATION_VERSION = 2


@dataclasses.dataclass(frozen=True)
class CollectiveModel:
    latency_s: float                                     # per call, small messages
    bus_bw: float                                        # B/s, NCCL "bus bandwidth"
    # measured (bytes, seconds), sorted by bytes
    curve: tuple[tuple[float, float], ...] = ()
    curve_devices: Optional[int] = None                  # group size the curve was measured at

    def time(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds for one `kind` collective over `n` devices; nbytes: the all-reduce's buffer,
        all-gather's result, reduce-scatter's input, all-to-all's bytes sent per device."""
        if n <= 1:
            return 0.0
        if self.curve:
            return _loglog(self.curve, max(nbytes, 1.0))
        if kind == "all-reduce":
            wire = 2.0 * (n - 1) / n * nbytes
        elif kind == "collective-permute":
            wire = nbytes
        else:
            wire = (n - 1) / n * nbytes
        return self.latency_s + wire / self.bus_bw


def _loglog(curve: Sequence[tuple[float, float]], x: float) -> float:
    """Log-log interpolation of (bytes, seconds); flat below the first point, last slope beyond the
    end."""
    xs = [c[0] for c in curve]
    if len(curve) == 1 or x <= xs[0]:
        return curve[0][1]
    i = min(bisect.bisect_right(xs, x), len(curve) - 1)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    if x1 == x0:
        return y1
    slope = (math.log(y1) - math.log(y0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + slope * (math.log(x) - math.log(x0)))


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float                  # device memory
    hbm_bw: float                     # achievable copy bandwidth, B/s (bytes read + written / time)
    bf16_flops: float                 # achievable dense bf16 matmul rate, FLOP/s
    interconnect: str                 # e.g. "NVLink 4 (NVSwitch)", "PCIe Gen5 x16"
    link_bw: float                    # per device, per direction, B/s
    collectives: Mapping[str, CollectiveModel]
    # fractions of hbm_bw that the decode kernels reach when reading weights / the cache
    gemv_efficiency: float = 0.88     # bf16 weight-streaming matmuls at small M
    int4_efficiency: float = 0.45     # fused INT4 expert kernels (Pallas / Marlin class)
    # (pairs per touched expert, efficiency) points replacing int4_efficiency
    int4_curve: tuple = ()
    # device time of one MoE layer's expert kernels beside their bytes
    int4_call_s: float = 0.0
    # ((share held, ((tokens, efficiency), ...)), ...) under EP: whole calls
    int4_ep_curves: tuple = ()
    xla_int4_efficiency: float = 0.08  # XLA's unfused dequant path (materializes bf16 weights)
    attention_efficiency: float = 0.8  # latent-cache reads in attention (steady state)
    attention_curve: tuple = ()        # (query rows per device, efficiency) points, as int4_curve
    # device time of one layer's attention call beside its cache read
    attention_call_s: float = 0.0
    # (query rows per device, seconds) points replacing attention_call_s
    attention_call_curve: tuple = ()
    matmul_efficiency: float = 1.0     # of bf16_flops (bf16_flops is already an achieved rate)
    # device time per layer of its small kernels beyond their bytes
    layer_overhead_s: float = 0.0
    kernels_per_layer: float = 0.0
    host_launch_s: float = 0.0
    # weight arrays a layer hands the jitted step (each one costs the host)
    arguments_per_layer: float = 0.0
    host_argument_s: float = 0.0
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def collective_time(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds of a collective (CollectiveModel.time; unmodelled kinds: the all-reduce's)."""
        model = self.collectives.get(kind)
        if model is None:
            ar = self.collectives["all-reduce"]
            model = CollectiveModel(ar.latency_s, ar.bus_bw)
        return model.time(kind, nbytes, n)

    def int4_efficiency_at(self, per_expert: float, call_bytes: float = 0.0) -> float:
        """Fraction of hbm_bw one MoE call's INT4 expert kernels reach: int4_curve at `per_expert`
        (token, expert) pairs per touched expert, with int4_call_s beside the call's `call_bytes`
        where given."""
        stream = _log_interp(self.int4_curve, per_expert, self.int4_efficiency)
        if not self.int4_call_s or call_bytes <= 0:
            return stream
        return call_bytes / (self.hbm_bw * self.int4_call_s + call_bytes / stream)

    def int4_efficiency_ep(self, tokens: float, share: float, per_expert: float = 1.0,
                           call_bytes: float = 0.0) -> float:
        """A call of `tokens` tokens holding `share` of the experts: the EP curves where measured
        (linear in log(share) between them), else `int4_efficiency_at(per_expert, call_bytes)`."""
        no_ep = self.int4_efficiency_at(per_expert, call_bytes)
        curves = sorted((float(sh), pts) for sh, pts in self.int4_ep_curves if sh < 1.0)
        if share >= 1.0 or not curves:
            return no_ep
        pts = [
            (
                sh,
                _log_interp(c, tokens, self.int4_efficiency)
                if tokens <= max(t for t, _ in c)
                else no_ep,
            )
            for sh, c in curves
        ]
        if share > pts[-1][0]:
            return no_ep
        return _log_interp(pts, share, no_ep, floor=0.0)

    def attention_efficiency_at(self, rows: float) -> float:
        """Share of hbm_bw decode attention streams the cache at, `rows` query rows per device."""
        return _log_interp(self.attention_curve, rows, self.attention_efficiency)

    def attention_call_at(self, rows: float) -> float:
        """Device seconds of one layer's attention call beside its cache read, `rows` query rows per
        device."""
        return _log_interp(self.attention_call_curve, rows, self.attention_call_s)

    def replace(self, **kw) -> "Hardware":
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        ar = self.collectives["all-reduce"]
        lat = (f"{1e6 * ar.curve[0][1]:.1f} us at {ar.curve[0][0]:.0f} B (curve)" if ar.curve
               else f"{1e6 * ar.latency_s:.1f} us + bytes/{ar.bus_bw / 1e9:.0f} GB/s")
        return (f"{self.name}: {self.hbm_bytes / 1e9:.0f} GB at {self.hbm_bw / 1e12:.2f} TB/s, "
                f"{self.bf16_flops / 1e12:.0f} TFLOP/s bf16, {self.interconnect} "
                f"{self.link_bw / 1e9:.0f} GB/s/dir, all-reduce {lat}")

    @classmethod
    def from_calibration(cls, path_or_dict) -> "Hardware":
        d = path_or_dict
        if not isinstance(d, Mapping):
            with open(path_or_dict) as f:
                d = json.load(f)
        base = preset(d.get("base", "h200"))
        colls = dict(base.collectives)
        n = d.get("n_devices")
        for kind, pts in (d.get("collectives") or {}).items():
            if kind not in KINDS:
                raise ValueError(f"calibration: unknown collective kind {kind!r} (known: {KINDS})")
            curve = tuple(sorted((float(b), float(s)) for b, s in pts))
            if not curve or any(b <= 0 or s <= 0 for b, s in curve):
                raise ValueError(
                    f"calibration: {kind} curve needs positive (bytes, seconds) points"
                )
            old = colls.get(kind, base.collectives["all-reduce"])
            colls[kind] = CollectiveModel(curve[0][1], old.bus_bw, curve, n)
        src = dict(base.sources)
        tag = f"measured ({d.get('source', 'calibration file')})"
        kw = {}
        if d.get("int4_curve") and int(d.get("version", CALIBRATION_VERSION)) < 2:
            raise ValueError(
                f"calibration {d.get('name', '')!r}: its int4_curve (version {d.get('version')}) "
                "is keyed on tokens per call; version 2 keys it on (token, expert) pairs per "
                "touched expert: measure it again"
            )
        for key, field in (
            ("hbm_bytes", "hbm_bytes"),
            ("copy_bw", "hbm_bw"),
            ("matmul_flops", "bf16_flops"),
            ("link_bw", "link_bw"),
            ("gemv_efficiency", "gemv_efficiency"),
            ("int4_efficiency", "int4_efficiency"),
            ("int4_call_s", "int4_call_s"),
            ("xla_int4_efficiency", "xla_int4_efficiency"),
            ("attention_efficiency", "attention_efficiency"),
            ("attention_call_s", "attention_call_s"),
            ("layer_overhead_s", "layer_overhead_s"),
            ("kernels_per_layer", "kernels_per_layer"),
            ("host_launch_s", "host_launch_s"),
            ("arguments_per_layer", "arguments_per_layer"),
            ("host_argument_s", "host_argument_s"),
            ("interconnect", "interconnect"),
        ):
            if d.get(key) is not None:
                kw[field] = d[key] if field == "interconnect" else float(d[key])
                src[field] = tag
        if "int4_efficiency" in kw:
            kw["int4_curve"] = ()          # a measured constant replaces the preset's curve
        if d.get("int4_curve"):
            kw["int4_curve"] = tuple((float(t), float(e)) for t, e in d["int4_curve"])
            src["int4_efficiency"] = tag
        if "int4_curve" in kw:
            kw["int4_ep_curves"] = ()      # the preset's EP curves belong to the preset's kernels
            kw.setdefault("int4_call_s", 0.0)
        if "attention_efficiency" in kw:
            kw["attention_curve"] = ()
        if d.get("attention_curve"):
            kw["attention_curve"] = tuple((float(t), float(e)) for t, e in d["attention_curve"])
            src["attention_efficiency"] = tag
        if "attention_call_s" in kw:
            kw["attention_call_curve"] = ()
        if d.get("attention_call_curve"):
            kw["attention_call_curve"] = tuple(
                (float(t), float(c)) for t, c in d["attention_call_curve"]
            )
            src["attention_call_s"] = tag
        for kind in (d.get("collectives") or {}):
            src[kind] = tag + (f", n={n}" if n else "")
        return dataclasses.replace(base, name=d.get("name", base.name + " (calibrated)"),
                                   collectives=colls, sources=src, **kw)


def calibration_dict(
    name: str,
    *,
    copy_bw: float,
    matmul_flops: Optional[float] = None,
    collectives: Optional[Mapping[str, Sequence[tuple[float, float]]]] = None,
    n_devices: Optional[int] = None,
    hbm_bytes: Optional[float] = None,
    base: str = "h200",
    source: str = "launch/bench/int4.py",
    **extra,
) -> dict:
    """The calibration file's contents (json.dump it): copy_bw B/s (read + written), matmul_flops
    bf16 FLOP/s, collectives {kind: [(bytes, seconds), ...]} over `n_devices`; extra: the fields in
    `allowed`."""
    allowed = {
        "link_bw",
        "gemv_efficiency",
        "int4_efficiency",
        "int4_curve",
        "int4_call_s",
        "xla_int4_efficiency",
        "attention_efficiency",
        "attention_curve",
        "attention_call_s",
        "attention_call_curve",
        "layer_overhead_s",
        "kernels_per_layer",
        "host_launch_s",
        "arguments_per_layer",
        "host_argument_s",
        "interconnect",
        "date",
        "device",
        "jax_version",
    }
    bad = set(extra) - allowed
    if bad:
        raise ValueError(
            f"calibration_dict: unknown fields {sorted(bad)} (allowed: {sorted(allowed)})"
        )
    d = {
        "version": CALIBRATION_VERSION,
        "name": name,
        "base": base,
        "source": source,
        "copy_bw": float(copy_bw),
    }
    if matmul_flops is not None:
        d["matmul_flops"] = float(matmul_flops)
    if hbm_bytes is not None:
        d["hbm_bytes"] = float(hbm_bytes)
    if n_devices is not None:
        d["n_devices"] = int(n_devices)
    if collectives:
        d["collectives"] = {k: [[float(b), float(s)] for b, s in v] for k, v in collectives.items()}
    d.update(extra)
    return d


def write_calibration(path: str, d: Mapping) -> str:
    Hardware.from_calibration(d)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
    return path


def _log_interp(points, x: float, default: float, floor: float = 1.0) -> float:
    """points [(x, y), ...] interpolated linearly in log(max(x, floor)), flat beyond the ends;
    `default` if none."""
    pts = sorted(points)
    if not pts:
        return default
    x = max(float(x), floor)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def _uniform(latency_s: float, bus_bw: float, curve=(), curve_devices=None, kinds=KINDS):
    m = CollectiveModel(latency_s, bus_bw, tuple(curve), curve_devices)
    return {k: (m if k == "all-reduce" else CollectiveModel(latency_s, bus_bw)) for k in kinds}


# the H200 preset's measured numbers and their sources: BENCHMARKS.md "The planner's calibration"
_H200_ALLREDUCE_CURVE = (
    (14336.0, 24.4e-6),
    (117760.0, 26.0e-6),
    (940032.0, 24.9e-6),
    (7654604.0, 43.8e-6),
)
# per MoE layer: INT4_CALL_S + bytes / (hbm_bw x efficiency at pairs per touched expert), as
# test_planner derives them
_H200_INT4_CURVE = (
    (1.0, 0.997),
    (128 / 110.2, 0.984),
    (512 / 281.4, 0.940),
    (2048 / 382.0, 0.869),
    (8.0, 0.844),
    (16.0, 0.444),
    (32.0, 0.223),
)
_H200_INT4_CALL_S = 13.9e-6
_H200_INT4_EP_CURVES = (
    (0.125, ((1.0, 0.248), (2.0, 0.351), (3.0, 0.422), (4.0, 0.454), (8.0, 0.512))),
    (0.25, ((1.0, 0.392), (2.0, 0.522), (4.0, 0.702), (8.0, 0.687))),
    (0.5, ((1.0, 0.546), (2.0, 0.703), (4.0, 0.800), (8.0, 0.811))),
)
_H200_ATTENTION_CURVE = ((8.0, 0.97), (64.0, 0.96))
_H200_ATTENTION_CALL_S = 34e-6
_H200_ATTENTION_CALL_CURVE = ((8.0, 28e-6), (64.0, 34e-6))
_H200_LAYER_OVERHEAD_S = 29e-6

_PRESETS = {
    "h200": Hardware(
        name="H200 SXM",
        hbm_bytes=141e9,
        hbm_bw=4.24e12,
        bf16_flops=790e12,
        interconnect="NVLink 4 (NVSwitch)",
        link_bw=450e9,
        collectives=_uniform(24e-6, 360e9, _H200_ALLREDUCE_CURVE, 2),
        gemv_efficiency=0.88,
        int4_efficiency=0.45,
        xla_int4_efficiency=0.08,
        int4_curve=_H200_INT4_CURVE,
        int4_call_s=_H200_INT4_CALL_S,
        int4_ep_curves=_H200_INT4_EP_CURVES,
        attention_curve=_H200_ATTENTION_CURVE,
        attention_call_s=_H200_ATTENTION_CALL_S,
        attention_call_curve=_H200_ATTENTION_CALL_CURVE,
        layer_overhead_s=_H200_LAYER_OVERHEAD_S,
        kernels_per_layer=31.0,
        host_launch_s=0.28e-6,
        arguments_per_layer=9.0,
        host_argument_s=1.4e-6,
        sources={
            "hbm_bytes": "datasheet (141 GB)",
            "hbm_bw": "measured: device-to-device copy 4.24 TB/s (ANCHORS.md section 6; datasheet "
            "4.8)",
            "bf16_flops": "measured: 790 TFLOP/s bf16 matmul on this project's H200 "
            "(datasheet 989)",
            "link_bw": "datasheet: NVLink 4, 900 GB/s bidirectional = 450 GB/s per direction",
            "all-reduce": "measured: 24.4 / 26.0 / 24.9 / 43.8 us at 14 KB / 115 KB / 918 KB / 7.3 "
            "MB (JAX psum, 2 x H200, BENCHMARKS.md calibration section); n > 2 uses the same curve",
            "all-gather": "assumed: 24 us + bytes / 360 GB/s bus bandwidth",
            "reduce-scatter": "assumed: 24 us + bytes / 360 GB/s bus bandwidth",
            "all-to-all": "assumed: 24 us + bytes / 360 GB/s bus bandwidth",
            "collective-permute": "assumed: 24 us + bytes / 360 GB/s",
            "gemv_efficiency": "measured: cuBLAS bf16 M=1 N=32768 K=7168 at 88% of copy "
            "(ANCHORS.md 6)",
            "int4_efficiency": "measured (int4_curve, int4_call_s): this project's Pallas MoE "
            "kernels on the H200, kernel time per MoE layer = 13.9 us + bytes at the curve's "
            "efficiency of copy by (token, expert) pairs per touched expert: 99.7% at 1 (the two "
            "one-token points, whole experts 60.8 us for 198.5 MB and one TP8 shard's slices 19.8 "
            "us for 25.0 MB, give both numbers), 98% at 1.16 and 94% at 1.82 (384 experts, 16 / 64 "
            "tokens), 87% at 5.4 (256 tokens), 84% / 44% / 22% at 8 / 16 / 32 (kimi-k2.5-61x16 at "
            "batch 16 / 32 / 64; BENCHMARKS.md, INT4 section, full depth on one H200, the decode "
            "step with one q_a / kv_a product); under EP (int4_ep_curves), device span at 1 / 8 "
            "tokens: 25% / 51% holding 1/8 of the experts, 39% / 69% holding 1/4, 55% / 81% "
            "holding 1/2 (BENCHMARKS.md, INT4 experts under expert parallelism)",
            "xla_int4_efficiency": "measured: XLA dequant path 0.34 TB/s effective = 8% "
            "(ANCHORS.md 6)",
            "attention_efficiency": "measured (attention_curve, attention_call_s): this project's "
            "MLA decode op on the H200, per layer 28 us + the cache at 97% of hbm_bw (8 heads) / "
            "34 us + 96% (64 heads) (BENCHMARKS.md, the planner's calibration)",
            "layer_overhead_s": "measured: 29 us per layer, fit to the batch-1 step of Kimi-K2.5 "
            "at 4 and 61 layers (BENCHMARKS.md, full depth on one H200)",
            "kernels_per_layer": "measured: 1,840-1,918 kernels a decode step at 61 layers, batch "
            "1 (TP8 shard, kimi-k2.5-61x16; BENCHMARKS.md, the decode step with one q_a / kv_a "
            "product)",
            "host_launch_s": "measured: host enqueue of the decode step with every buffer fixed "
            "(the runner's fixed buffers: XLA launches its CUDA graph as recorded), 1.28 ms at 61 "
            "layers (kimi-k2.5-61x16, H100), less its 557 arrays' share (1.35 us each in that "
            "process): 0.28 us a kernel for 1,915 kernels (BENCHMARKS.md, fixed buffers and packed "
            "vectors). With buffers that move, XLA re-records the graph: 2.3 us a kernel",
            "arguments_per_layer": "counted: 557 weight arrays at 61 layers (9 a layer, 8 for the "
            "model) with per-layer weights, the joint gate / up and packed vectors",
            "host_argument_s": "measured: 1.41 us an argument (a no-op dispatched over the 861 "
            "weight arrays, 1,248 us against 35 us without them; H100 machine of the same kind, "
            "BENCHMARKS.md, the host's enqueue)",
        },
    ),
    "h100": Hardware(
        name="H100 SXM",
        hbm_bytes=80e9,
        hbm_bw=3.0e12,
        bf16_flops=700e12,
        interconnect="NVLink 4 (NVSwitch)",
        link_bw=450e9,
        collectives=_uniform(24e-6, 360e9),
        sources={
            "hbm_bytes": "datasheet (80 GB)",
            "hbm_bw": "assumed: 90% of the 3.35 TB/s datasheet (the H200 copy reaches 88%)",
            "bf16_flops": "assumed: ~71% of the 989 TFLOP/s datasheet (the H200 ratio is 80%)",
            "link_bw": "datasheet: NVLink 4, 450 GB/s per direction",
            "all-reduce": "assumed: 24 us + bytes / 360 GB/s (as H200, same NVLink generation)",
        },
    ),
    "b200": Hardware(
        name="B200",
        hbm_bytes=180e9,
        hbm_bw=7.2e12,
        bf16_flops=1800e12,
        interconnect="NVLink 5 (NVSwitch)",
        link_bw=900e9,
        collectives=_uniform(20e-6, 720e9),
        sources={
            "hbm_bytes": "datasheet (HGX B200: 180 GB per GPU; 192 GB physical)",
            "hbm_bw": "assumed: 90% of the 8 TB/s datasheet",
            "bf16_flops": "assumed: 80% of the 2.25 PFLOP/s dense bf16 datasheet",
            "link_bw": "datasheet: NVLink 5, 1.8 TB/s bidirectional = 900 GB/s per direction",
            "all-reduce": "assumed: 20 us + bytes / 720 GB/s",
        },
    ),
    "rtx-pro-6000": Hardware(
        name="RTX PRO 6000 Blackwell (PCIe Gen5)",
        hbm_bytes=96e9,
        hbm_bw=1.8e12,
        bf16_flops=400e12,
        interconnect="PCIe Gen5 x16 (no NVLink)",
        link_bw=64e9,
        collectives=_uniform(78e-6, 40e9),
        gemv_efficiency=0.88,
        int4_efficiency=0.45,
        sources={
            "hbm_bytes": "datasheet (96 GB GDDR7)",
            "hbm_bw": "datasheet: 1.79 TB/s GDDR7 ('about 1.8 TB/s', the published input)",
            "bf16_flops": "assumed: 80% of ~500 TFLOP/s dense bf16 (derived from the 4 PFLOP/s "
            "FP4-sparse datasheet figure)",
            "link_bw": "datasheet: PCIe Gen5 x16, 64 GB/s per direction",
            "all-reduce": "measured (profiled): 78 us per all-reduce in the 8-GPU TP8 Kimi-K2.5 "
            "deployment (its profile: 127 all-reduces, 9.88 ms of NCCL). With CUDA graphs NCCL is "
            "~36 us (16 GPUs, b12x PR 139) and a custom all-reduce 18 us (ANCHORS.md 2)",
            "all-gather": "assumed: 78 us + bytes / 40 GB/s bus bandwidth",
            "reduce-scatter": "assumed: 78 us + bytes / 40 GB/s bus bandwidth",
            "all-to-all": "assumed: 78 us + bytes / 40 GB/s bus bandwidth",
            "collective-permute": "assumed: 78 us + bytes / 40 GB/s",
            "gemv_efficiency": "assumed: as H200 (88% of copy)",
            "int4_efficiency": "assumed: 45% of copy (Marlin-class INT4 MoE)",
        },
    ),
    # the host CPU as the "device" (tests, dry runs): numbers are placeholders
    "cpu": Hardware(
        name="CPU (simulated devices)",
        hbm_bytes=64e9,
        hbm_bw=20e9,
        bf16_flops=0.2e12,
        interconnect="shared memory",
        link_bw=10e9,
        collectives=_uniform(50e-6, 10e9),
        sources={"*": "assumed placeholders for dry runs"},
    ),
}
PRESET_ALIASES = {"h200-sxm": "h200", "h100-sxm": "h100", "rtx6000": "rtx-pro-6000",
                  "rtx-pro-6000-pcie": "rtx-pro-6000",
                  "rtx6kpro": "rtx-pro-6000"}
PRESETS = tuple(_PRESETS)


def preset(name: str) -> Hardware:
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key not in _PRESETS:
        raise ValueError(
            f"unknown hardware preset {name!r} (known: {', '.join(PRESETS)}; or a calibration "
            ".json)"
        )
    return _PRESETS[key]


def get(name_or_path: str) -> Hardware:
    """A preset by name, or a calibration JSON file by path."""
    if name_or_path.endswith(".json"):
        return Hardware.from_calibration(name_or_path)
    return preset(name_or_path)
