"""What a count answers, as plain records the trainer's check reads back from its child process without loading the
counting code: `PassMemory` (one training pass), `StepEstimate` (the worst step of a side, per part)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec import FitSpec

GIB = 2**30


@dataclass
class PassMemory:
    """Bytes of one training forward + backward, counted on the accelerator (host: what it moved to the CPU)."""

    saved: int  # autograd's saved tensors on the accelerator at the end of the forward (before offloading moves them)
    after_forward: int  # alive on the accelerator when the forward returned
    forward_peak: int
    peak: int  # most bytes alive at once on the accelerator, forward and backward
    after_backward: int  # what stays: the gradients
    host_peak: int = 0  # most bytes alive at once on the host
    items_faked: int = 0

    def gib(self) -> dict:
        return {name: getattr(self, name) / GIB for name in ("saved", "after_forward", "forward_peak", "peak")}


@dataclass
class StepEstimate:
    """The worst step's peak of one side, per part (bytes)."""

    side: str
    spec: FitSpec
    static: dict
    training: PassMemory
    generation: dict
    seconds: tuple[float, float] | None = None  # (wall, CPU) of the trainer's check, when it ran one
    turned_on: dict = field(default_factory=dict)  # the memory settings fit_check='auto' turned on to get here

    @property
    def static_total(self) -> int:
        return sum(self.static.values())

    @property
    def training_peak(self) -> int:
        return self.training.peak

    @property
    def total(self) -> int:
        return self.static_total + max(self.training_peak, self.generation["peak"])

    @property
    def binding(self) -> str:
        return "training pass" if self.training_peak >= self.generation["peak"] else "generation"

    def parts(self) -> dict[str, int]:
        static = self.static
        return {
            "weights": static["weights"] + static["reference_model"] + static["dequantized_layer"],
            "trainable weights + gradients + optimizer": static["trainable"]
            + static["gradients"]
            + static["optimizer"],
            "training pass (activations, peak)": self.training_peak,
            "generation (KV cache + step)": self.generation["peak"],
            "worst step": self.total,
        }
