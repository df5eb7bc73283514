"""The paper's numbers (Wu et al., "StreamBox", USENIX ATC'24, section 9), each with its quote and place.

Every figure table sets one of these beside our measurement. A reduction of X% is stored as the factor
StreamBox / baseline = 1 - X/100 (-71% memory -> 0.29x), a speed-up as the factor itself (1.46x), so that
ours / paper is one ratio whatever the metric. "up to" numbers are the paper's best case, not its mean.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PaperNumber:
    """One number of the paper: `factor` (StreamBox / baseline, or an absolute value in `unit`)."""

    key: str
    factor: float
    unit: str  # "x" for factors, else the unit of an absolute value
    quote: str  # the paper's words
    where: str  # section and figure
    qualifier: str = (
        ""  # how the paper bounds it: "up to" (its best case), or the range a mid-point stands for
    )

    def headline(self) -> str:
        """As the paper says it: a reduction as a percentage (-71%), a speed-up as a factor (1.46x)."""
        if self.unit != "x":
            value = f"{self.factor:g} {self.unit}"
        else:
            value = f"{(self.factor - 1) * 100:+.0f}%" if self.factor < 1 else f"{self.factor:g}x"
        return f"{self.qualifier} {value}".strip()

    def describe(self) -> str:
        """For a table: the factor and its change, after the paper's bound (up to 0.51x (-49%))."""
        if self.unit == "x":
            value = f"{self.factor:.2f}x ({(self.factor - 1) * 100:+.0f}%)"
        else:
            value = f"{self.factor:g} {self.unit}"
        return f"{self.qualifier} {value}".strip()


def _reduction(key: str, percent: float, quote: str, where: str) -> PaperNumber:
    return PaperNumber(key, round(1 - percent / 100, 4), "x", quote, where)


def _speedup(key: str, factor: float, quote: str, where: str) -> PaperNumber:
    return PaperNumber(key, factor, "x", quote, where)


_NUMBERS = (
    # Figure 12: mean memory (sec. 9.1)
    _reduction(
        "12.mean_memory.stream-only",
        71,
        "StreamBox reduces memory footprint by 71% compared to Stream-only",
        "sec. 9.1, Fig. 12 (right)",
    ),
    _reduction(
        "12.mean_memory.infless",
        80.5,
        "StreamBox can reduce [mean memory] by 79%-82% compared to INFless and Astraea (mid of the range)",
        "sec. 9.1, Fig. 12 (right)",
    ),
    _reduction(
        "12.mean_memory.astraea",
        80.5,
        "StreamBox can reduce [mean memory] by 79%-82% compared to INFless and Astraea (mid of the range)",
        "sec. 9.1, Fig. 12 (right)",
    ),
    # Figure 13: throughput (sec. 9.1)
    _speedup(
        "13.throughput.stream-only",
        1.46,
        "Compared with Stream-only, StreamBox can improve the throughput by 1.46x",
        "sec. 9.1, Fig. 13",
    ),
    _speedup(
        "13.throughput.infless",
        6.7,
        "improves the throughput by 6.7x and 5.3x on average compared with that of INFless and Astraea",
        "sec. 9.1, Fig. 13",
    ),
    _speedup(
        "13.throughput.astraea",
        5.3,
        "improves the throughput by 6.7x and 5.3x on average compared with that of INFless and Astraea",
        "sec. 9.1, Fig. 13",
    ),
    # Figure 14: latency (sec. 9.1)
    _reduction(
        "14.latency.stream-only",
        49,
        "StreamBox still outperforms stream-only by up to 49% on average",
        "sec. 9.1, Fig. 14(c)",
    ),
    _reduction(
        "14.latency.infless",
        98,
        "StreamBox reduces the end-to-end latency by up to 98% compared to INFless and Astraea",
        "sec. 9.1, Fig. 14(c)",
    ),
    _reduction(
        "14.latency.astraea",
        98,
        "StreamBox reduces the end-to-end latency by up to 98% compared to INFless and Astraea",
        "sec. 9.1, Fig. 14(c)",
    ),
    PaperNumber(
        "14.startup_ms.streambox",
        5.0,
        "ms",
        "reducing startup latency from 5.8 s to 5 ms",
        "sec. 9.1, Fig. 14(c)",
    ),
    PaperNumber(
        "14.slo_ms",
        200.0,
        "ms",
        "StreamBox achieves the lowest latency and SLO (200ms) violation",
        "sec. 9.1, Fig. 14(a)",
    ),
    # Figure 15: memory pool ablation (sec. 9.2)
    _reduction(
        "15.memory.static",
        91,
        "StreamBox reduces memory usage by up to 91% compared to "
        "Stream-only due to the fine-grained memory management",
        "sec. 9.2, Fig. 15 (left)",
    ),
    _reduction(
        "15.memory.fm",
        67,
        "StreamBox reduces footprint by 67% compared with stream+FM due to resilient memory pool",
        "sec. 9.2, Fig. 15 (left)",
    ),
    _reduction(
        "15.time.static",
        34,
        "StreamBox reduces the execution time by up to 34% compared with "
        "Stream-only, because lazy allocation hides the memory allocation overhead",
        "sec. 9.2, Fig. 15 (left)",
    ),
    # Figure 16: communication (sec. 9.2)
    _reduction(
        "16.comm.func-ipc",
        94,
        "StreamBox reduces the communication overhead by 94% compared to INFless (Function-IPC)",
        "sec. 9.2, Fig. 16 (left)",
    ),
    _reduction("16.comm.stream-only", 73, "and by 73% compared to Stream-only", "sec. 9.2, Fig. 16 (left)"),
    _reduction(
        "16.comm.pa",
        55,
        "PA and AM reduce the communication overhead by 55% and 72%",
        "sec. 9.2, Fig. 16 (right)",
    ),
    _reduction(
        "16.comm.am",
        72,
        "PA and AM reduce the communication overhead by 55% and 72%",
        "sec. 9.2, Fig. 16 (right)",
    ),
    # Figure 17: pipelined loading (sec. 9.2)
    _reduction(
        "17.loading.stream-only",
        91,
        "StreamBox reduces latency by 91% compared to Stream-only "
        "because of efficient I/O sharing between streams",
        "sec. 9.2, Fig. 17 (left)",
    ),
    _speedup(
        "17.loading.stream-only_over_mps",
        3.2,
        "Stream-only significantly amplifies latency by 3.2x on average compared to INFless",
        "sec. 9.2, Fig. 17 (left)",
    ),
    PaperNumber(
        "17.rz_pb_share_of_gain",
        0.85,
        "share",
        "Data block rightsize and pinned memory buffer bring "
        "major performance improvement, accounting for 85% of the total gain",
        "sec. 9.2, Fig. 17 (right)",
    ),
    # Figure 18: overheads (sec. 9.3)
    PaperNumber(
        "18.forwarding_us.max",
        5.0,
        "us",
        "the overhead of API forwarding is only 1us-3us, and it "
        "remains within the range of 3us-5us as the concurrency of functions increases to 48",
        "sec. 9.3, Fig. 18(a)",
    ),
    _reduction(
        "18.ptb.drop",
        3,
        "It has been proven to improve GPU utilization without affecting "
        "performance (3% performance drop as shown in Fig. 18(b))",
        "sec. 9.3, Fig. 18(b)",
    ),
    PaperNumber(
        "18.profiling_s",
        36.0,
        "s",
        "the average time for offline profiling and transformation is 36s and 4s, respectively",
        "sec. 9.3, Fig. 18(c)",
    ),
    PaperNumber(
        "18.transformation_s",
        4.0,
        "s",
        "the average time for offline profiling and transformation is 36s and 4s, respectively",
        "sec. 9.3, Fig. 18(c)",
    ),
    # Figure 19: users of Traffic on one GPU (sec. 9.4): no number, an ordering; held as the bound 1.0x
    PaperNumber(
        "19.memory.lowest",
        1.0,
        "x",
        "Although the memory usage under streambox slightly increased, it is still the lowest",
        "sec. 9.4, Fig. 19(a)",
    ),
    PaperNumber(
        "19.latency.leftmost",
        1.0,
        "x",
        "Nevertheless, StreamBox's curve remains on the leftmost in the graph",
        "sec. 9.4, Fig. 19(b), (c)",
    ),
)

#: The paper's bounds on some numbers: "up to" is its best case, not its mean.
_QUALIFIERS = {
    "12.mean_memory.infless": "-79% to -82%, mid:",
    "12.mean_memory.astraea": "-79% to -82%, mid:",
    "14.latency.stream-only": "up to",
    "14.latency.infless": "up to",
    "14.latency.astraea": "up to",
    "15.memory.static": "up to",
    "15.time.static": "up to",
    "19.memory.lowest": "below",  # an ordering: StreamBox / every baseline under 1
    "19.latency.leftmost": "below",
}

#: key -> the paper's number; keys read "<figure>.<metric>.<baseline or variant>".
PAPER: dict[str, PaperNumber] = {n.key: replace(n, qualifier=_QUALIFIERS.get(n.key, "")) for n in _NUMBERS}


def paper_number(key: str) -> PaperNumber | None:
    """The paper's number for `key`, None where the paper gives none (a qualitative statement)."""
    return PAPER.get(key)
