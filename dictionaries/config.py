"""What a dictionary is and how it is trained: one dataclass each, mirrored by the training job's flags.

The names and defaults are SAELens 6.54's (``sae_lens/saes/*_sae.py``'s training configs and
``SAETrainerConfig``), so that a setting means here what it means there.
"""

from __future__ import annotations

import dataclasses

from common.cli import UserError, flag

# SAELens's training architectures (``TrainingSAE`` subclasses), each with its losses (dictionaries.sae).
ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk")
TOP_K = ("topk", "batchtopk", "matryoshka_batchtopk")  # chosen by size; the AuxK loss on dead latents
BATCH_TOP_K = ("batchtopk", "matryoshka_batchtopk")    # chosen over the batch; a running threshold (saved as JumpReLU)
SPARSITY_LOSS_MODES = ("step", "tanh", "quadratic")     # JumpReLU's L0 penalty
LR_SCHEDULES = ("constant", "cosineannealing", "cosineannealingwarmrestarts")
DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class DictionaryConfig:
    """One dictionary: its architecture, widths and sparsity settings (SAELens's names)."""
    architecture: str = flag("topk", f"one of {', '.join(ARCHITECTURES)}")
    d_sae: int = flag(0, "latents (0: expansion x the input's width)")
    expansion: int = flag(8, "latents per input dimension where --d_sae is 0")
    k: float = flag(32, "topk: latents firing per token; batchtopk and matryoshka: per token on average")
    l1_coefficient: float = flag(5.0, "standard: weight of the L1 penalty (each latent times its decoder row's norm)")
    l1_warm_up_steps: int = flag(0, "standard: steps over which the L1 weight rises linearly from 0")
    l0_coefficient: float = flag(1.0, "jumprelu: weight of the L0 penalty")
    l0_warm_up_steps: int = flag(0, "jumprelu: steps over which the L0 weight rises linearly from 0")
    jumprelu_init_threshold: float = flag(0.01, "jumprelu: every threshold's initial value")
    jumprelu_bandwidth: float = flag(0.05, "jumprelu: width of the straight-through estimator's window")
    jumprelu_sparsity_loss_mode: str = flag("step", f"jumprelu: L0 penalty, one of {', '.join(SPARSITY_LOSS_MODES)}")
    jumprelu_tanh_scale: float = flag(4.0, "jumprelu, tanh mode: the penalty's scale")
    target_l0: float | None = flag(None, "jumprelu, quadratic mode: the L0 the penalty pulls toward")
    pre_act_loss_coefficient: float | None = flag(None, "jumprelu: weight of the loss pushing dead latents' "
                                                  "pre-activations up to their threshold (off by default)")
    aux_loss_coefficient: float = flag(1.0, "top-k kinds: weight of the AuxK loss on dead latents")
    rescale_acts_by_decoder_norm: bool = flag(True, "top-k kinds: choose and decode latents by their "
                                              "pre-activations times their decoder row's norm")
    topk_threshold_lr: float = flag(0.01, "batchtopk kinds: rate of the running threshold saved for inference")
    matryoshka_widths: tuple[int, ...] = flag((), "matryoshka_batchtopk: nested prefix widths (d_sae appended)")
    use_matryoshka_aux_loss: bool = flag(False, "matryoshka_batchtopk: an AuxK loss per prefix level")
    decoder_init_norm: float = flag(0.1, "each decoder row's norm at initialisation")
    skip: bool = flag(False, "a transcoder with an affine skip W_skip (a skip-transcoder)")

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UserError(f"unknown architecture {self.architecture!r}: one of {', '.join(ARCHITECTURES)}")
        if self.jumprelu_sparsity_loss_mode not in SPARSITY_LOSS_MODES:
            raise UserError(f"--jumprelu_sparsity_loss_mode must be one of {', '.join(SPARSITY_LOSS_MODES)}, "
                            f"got {self.jumprelu_sparsity_loss_mode!r}")
        if self.d_sae < 0 or (self.d_sae == 0 and self.expansion < 1):
            raise UserError(f"--d_sae must be positive (or 0 with --expansion >= 1), got {self.d_sae}")
        if self.architecture in TOP_K and self.k <= 0:
            raise UserError(f"--k must be positive, got {self.k}")
        if self.architecture == "topk" and self.k != int(self.k):
            raise UserError(f"--k must be a whole number for topk, got {self.k}")
        widths = self.matryoshka_widths
        if self.architecture == "matryoshka_batchtopk":
            if not widths or any(w < 1 for w in widths) or list(widths) != sorted(set(widths)):
                raise UserError(f"--matryoshka_widths must be positive and increasing, got {list(widths)}")
        if self.architecture == "jumprelu" and self.jumprelu_sparsity_loss_mode == "quadratic" and not self.target_l0:
            raise UserError("--jumprelu_sparsity_loss_mode quadratic needs --target_l0")
        for name in ("l1_warm_up_steps", "l0_warm_up_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")

    def width(self, d_in: int) -> int:
        """The number of latents for an input of width ``d_in``."""
        return self.d_sae or self.expansion * d_in

    def widths(self, d_sae: int) -> tuple[int, ...]:
        """Matryoshka's prefix widths, ending at ``d_sae`` (appended as SAELens does)."""
        return tuple(self.matryoshka_widths) + ((d_sae,) if not self.matryoshka_widths
                                                or self.matryoshka_widths[-1] != d_sae else ())


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam and its schedules as SAELens's ``SAETrainer`` runs them: the global gradient norm
    clipped to 1 before every step, the learning rate warmed up and decayed per step."""
    lr: float = flag(3e-4, "Adam's learning rate")
    lr_end: float | None = flag(None, "the cosine schedules' final rate (default: lr / 10)")
    lr_scheduler_name: str = flag("constant", f"one of {', '.join(LR_SCHEDULES)}")
    lr_warm_up_steps: int = flag(0, "steps over which the rate rises linearly to --lr")
    lr_decay_steps: int = flag(0, "last steps over which the rate falls linearly to 0")
    n_restart_cycles: int = flag(1, "cosineannealingwarmrestarts: cycles")
    adam_beta1: float = flag(0.9, "Adam's beta1")
    adam_beta2: float = flag(0.999, "Adam's beta2")
    dead_feature_window: int = flag(1000, "a latent that fired in none of the last N steps is dead (AuxK's)")

    def validate(self, steps: int) -> None:
        if self.lr_scheduler_name not in LR_SCHEDULES:
            raise UserError(f"--lr_scheduler_name must be one of {', '.join(LR_SCHEDULES)}, "
                            f"got {self.lr_scheduler_name!r}")
        if self.lr_warm_up_steps < 0 or self.lr_decay_steps < 0:
            raise UserError("--lr_warm_up_steps and --lr_decay_steps must be >= 0")
        if self.lr_warm_up_steps + self.lr_decay_steps > steps:
            raise UserError(f"--lr_warm_up_steps + --lr_decay_steps ({self.lr_warm_up_steps + self.lr_decay_steps}) "
                            f"exceed the training's {steps} steps")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.lr_end is None else self.lr_end
