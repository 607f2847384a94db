"""Loss scaling for fp16 (dynamic) and bf16/fp32 (static 1.0), with DeepSpeed's semantics.

Dynamic rule (DeepSpeed's DynamicLossScaler): on an overflow the step is skipped and,
once ``hysteresis`` overflows have been absorbed, the scale is divided by
``scale_factor`` (never below ``min_scale``); after ``scale_window`` steps without an
overflow it is multiplied by ``scale_factor``. The overflow flag fed to ``update`` must
already be agreed by every rank (see ``ZeroOptimizer``), so every rank takes the same
decision. The state is a plain dict so a checkpoint holding it loads without our code.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScalerConfig:
    dynamic: bool = True
    initial_scale_power: int = 16     # DeepSpeed's default: 2**16
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    static_scale: float = 1.0         # used when dynamic is False

    @classmethod
    def from_any(cls, cfg) -> "LossScalerConfig":
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, dict):
            known = {k: v for k, v in cfg.items() if k in cls.__dataclass_fields__}
            unknown = set(cfg) - set(known)
            if unknown:
                raise ValueError(f"unknown loss-scaler option(s) {sorted(unknown)}; "
                                 f"known: {sorted(cls.__dataclass_fields__)}")
            return cls(**known)
        raise TypeError(f"loss_scaler must be a dict or LossScalerConfig, got {type(cfg).__name__}")


class LossScaler:
    """Current scale and the bookkeeping that moves it."""

    def __init__(self, config: LossScalerConfig | dict | None = None, enabled: bool = True):
        self.config = LossScalerConfig.from_any(config)
        self.dynamic = bool(enabled and self.config.dynamic)
        cfg = self.config
        self.cur_scale = float(2 ** cfg.initial_scale_power) if self.dynamic else (
            float(cfg.static_scale) if enabled else 1.0)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = cfg.hysteresis

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Advance one step; ``overflow`` must be the same on every rank."""
        if not self.dynamic:
            self.cur_iter += 1
            return
        cfg = self.config
        if overflow:
            if cfg.hysteresis == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / cfg.scale_factor, cfg.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if cfg.consecutive_hysteresis:
                self.cur_hysteresis = cfg.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % cfg.scale_window == 0:
                if not cfg.consecutive_hysteresis:
                    self.cur_hysteresis = cfg.hysteresis
                self.cur_scale *= cfg.scale_factor
        self.cur_iter += 1

    # ---- checkpointing --------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain-dict state, with DeepSpeed's attribute names."""
        cfg = self.config
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis,
                "scale_factor": cfg.scale_factor, "scale_window": cfg.scale_window,
                "min_scale": cfg.min_scale, "delayed_shift": cfg.hysteresis,
                "consecutive_hysteresis": cfg.consecutive_hysteresis, "dynamic": self.dynamic,
                "config": asdict(cfg)}

    def load_state_dict(self, state) -> None:
        """Restore from our dict or from a DeepSpeed LossScaler/DynamicLossScaler object."""
        get = (lambda k, d=None: state.get(k, d)) if isinstance(state, dict) else (
            lambda k, d=None: getattr(state, k, d))
        self.cur_scale = float(get("cur_scale", self.cur_scale))
        self.cur_iter = int(get("cur_iter", self.cur_iter))
        self.last_overflow_iter = int(get("last_overflow_iter", self.last_overflow_iter))
        self.cur_hysteresis = int(get("cur_hysteresis", self.cur_hysteresis))
