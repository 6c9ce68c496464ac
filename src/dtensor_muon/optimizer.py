"""``dtensor_muon.Muon``: torch.optim.Muon's interface, for whole models, on one device or over DTensors.

Matrices (see :mod:`dtensor_muon.routing` for the rule) get Muon's orthogonalized momentum update; everything
else gets AdamW. Each user param group is split into a Muon group (``"use_muon": True``) and an AdamW group
(``"use_muon": False``, with ``lr``/``weight_decay`` set from ``adamw_lr``/``adamw_weight_decay`` when given),
so learning-rate schedulers scale both; each gets its own ``lr`` (a Tensor lr is cloned for the second).
The routing is logged at construction (logger ``dtensor_muon``), and unnamed parameters that look like an
embedding or an output head raise a ``UserWarning``.

State is created eagerly for every parameter that requires grad: ``momentum_buffer`` for Muon parameters;
``step``, ``exp_avg``, ``exp_avg_sq`` for AdamW parameters, each in its parameter's layout. A parameter with
``requires_grad=False`` gets no state and no place in the plans until it requires grad (then its first step
creates fresh state, as torch's optimizers do). ``copy.deepcopy`` and ``pickle`` give an optimizer that takes
the same next step (its engine is rebuilt; overlap hooks are not copied: call ``attach`` on the copy).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from .engine import EXCHANGE_MODES, Engine, Entry
from .kernels import resolve_ns_algorithm
from .layout import read_layout
from .newton_schulz import KELLER_COEFFICIENTS, CoefficientSpec, resolve_coefficients, resolve_ns_dtype
from .overlap import attach_hooks
from .routing import unnamed_lookalikes, uses_muon
from .rules import adamw as adamw_rule
from .rules.muon import ADJUST_LR_NAMES, AdjustLrFn

MAX_NS_STEPS = 99  # torch.optim.Muon: "Number of steps must be less than 100 for computational efficiency"

logger = logging.getLogger("dtensor_muon")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_hyperparameters(group: dict[str, Any]) -> None:
    """Raise ValueError/TypeError naming the first bad hyperparameter of a param group.

    Where torch.optim.Muon checks the same argument, the message carries torch's words after the name.
    """
    for key in ("lr", "weight_decay", "momentum", "eps", "adamw_eps"):
        value = group[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
            raise TypeError(f"{key} must be a number, got {type(value).__name__}")
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"lr: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    _require(lr >= 0, f"lr: Learning rate should be >= 0 but is: {lr}")
    _require(group["weight_decay"] >= 0, f"weight_decay: weight decay should be >= 0 but is: {group['weight_decay']}")
    _require(group["momentum"] >= 0, f"momentum: momentum should be >= 0 but is: {group['momentum']}")
    _require(group["momentum"] < 1, f"momentum: momentum should be < 1 but is: {group['momentum']}")
    _require(group["eps"] > 0, f"eps: eps should be > 0 but is: {group['eps']}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"ns_steps must be an int, got {type(steps).__name__}")
    _require(steps >= 1, f"ns_steps: ns_steps should be >= 1 but is: {steps}")
    _require(
        steps <= MAX_NS_STEPS,
        f"ns_steps: Number of steps must be less than {MAX_NS_STEPS + 1} for computational efficiency, got {steps}",
    )
    resolve_coefficients(group["ns_coefficients"])
    resolve_ns_dtype(group["ns_dtype"])
    resolve_ns_algorithm(group["ns_algorithm"])
    fn = group["adjust_lr_fn"]
    _require(
        fn is None or fn in ADJUST_LR_NAMES or (callable(fn) and not isinstance(fn, str)),
        f"adjust_lr_fn: Adjust learning rate function {fn} is not supported; expected None, "
        f"{' or '.join(repr(n) for n in ADJUST_LR_NAMES)} or a callable (lr, (A, B)) -> lr",
    )
    betas = group["adamw_betas"]
    _require(
        isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas),
        f"adamw_betas must be two numbers in [0, 1), got {betas!r}",
    )
    _require(group["adamw_eps"] > 0, f"adamw_eps must be > 0, got {group['adamw_eps']}")
    for key in ("adamw_lr", "adamw_weight_decay"):
        value = group[key]
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(f"{key}: Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
        _require(value is None or value >= 0, f"{key} must be None or >= 0, got {value}")
    _require(
        group["use_muon"] in (None, True, False), f"use_muon must be None, True or False, got {group['use_muon']!r}"
    )


def _name_patterns(members: list[tuple[str, Tensor]]) -> str:
    """Names with numeric components as ``*`` (``layers.*.attention.wq.weight ×32``), in first-seen order."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for label, _ in members:
        pattern = label if label.startswith("params[") else re.sub(r"(?<![^.])\d+(?![^.])", "*", label)
        counts[pattern] = counts.get(pattern, 0) + 1
        first.setdefault(pattern, label)
    return ", ".join(f"{pattern} ×{n}" if n > 1 else first[pattern] for pattern, n in counts.items())


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest; exact on DTensor (FSDP2) parameters.

    Args (shared with torch.optim.Muon, same meaning and defaults):
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or param groups.
        lr: learning rate γ, a float or a 1-element Tensor (AdamW's too unless ``adamw_lr`` is given).
        weight_decay: decoupled weight decay λ: θ ← θ·(1 − γλ).
        momentum: μ in [0, 1).
        nesterov: use g + μ·(B − g) instead of B.
        ns_coefficients: (a, b, c), a list of triples (one per iteration, last repeated) or a name from
            :data:`dtensor_muon.newton_schulz.NAMED_COEFFICIENTS`.
        eps: Frobenius-normalization floor of Newton–Schulz.
        ns_steps: Newton–Schulz iterations, 1 to 99.
        adjust_lr_fn: None/"original" (√max(1, A/B)), "match_rms_adamw" (0.2·√max(A, B)), or a callable
            ``(lr, (A, B)) -> lr`` for an A×B matrix.
    Keyword-only:
        adamw_betas, adamw_eps, adamw_lr, adamw_weight_decay: AdamW for element-wise parameters.
        ns_dtype: Newton–Schulz working dtype (bfloat16, float32, float16).
        ns_algorithm: "auto" (Gram Newton–Schulz where it is faster and validated: Keller's coefficients,
            large rectangular matrices on the GPU backend), "standard" or "gram" (measured as accurate as
            the standard form for Keller's, quintic and 8-step Polar Express coefficients; not for CANS or
            5-step Polar Express); see :func:`dtensor_muon.newton_schulz.newton_schulz`.
        wire_dtype: dtype of the exchange (bf16 by default; None = parameter dtype). Must not round the
            Newton–Schulz input: bf16 with float32 ns_dtype is refused.
        bucket_size_mb: full-matrix megabytes per exchange bucket.
        exchange: "owner" (each matrix on one owner rank) or "gather_all" (baseline: every rank computes all).
        skip_nonfinite: if any rank sees an inf/NaN gradient, every rank skips the step.
        diagnostics_interval: every N steps, measure the orthogonality error and AdamW update RMS (0: never).
        overlap: ``step()`` returns with the return exchanges in flight; each module's updates are applied by
            a forward pre-hook just before FSDP all-gathers it (call :meth:`attach` with the model), and
            everything is flushed before the next step, any ``state_dict()`` and by :meth:`flush`.
        ns_cuda_graphs: on CUDA, replay each owner's Newton–Schulz from a CUDA graph per matrix shape (same
            bits; for matrices of up to 2³⁴ multiply-adds per Gram matrix, e.g. 2048×4096, whose eager
            launches cost the host longer than the GPU work, see :mod:`dtensor_muon.ns_graphs`). Each graph
            keeps a few matrices of memory.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: AdjustLrFn = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_algorithm: str = "auto",
        wire_dtype: torch.dtype | None = torch.bfloat16,
        bucket_size_mb: float = 64.0,
        exchange: str = "owner",
        skip_nonfinite: bool = False,
        diagnostics_interval: int = 0,
        overlap: bool = False,
        ns_cuda_graphs: bool = True,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError(f"lr: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        _require(exchange in EXCHANGE_MODES, f"exchange must be one of {EXCHANGE_MODES}, got {exchange!r}")
        _require(bucket_size_mb > 0, f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        _require(
            isinstance(diagnostics_interval, int) and diagnostics_interval >= 0,
            f"diagnostics_interval must be an int >= 0, got {diagnostics_interval!r}",
        )
        _require(
            wire_dtype is None or (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point),
            f"wire_dtype must be None or a floating dtype, got {wire_dtype!r}",
        )
        _require(isinstance(ns_cuda_graphs, bool), f"ns_cuda_graphs must be a bool, got {ns_cuda_graphs!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_lr=adamw_lr,
            adamw_weight_decay=adamw_weight_decay,
            ns_dtype=ns_dtype,
            ns_algorithm=ns_algorithm,
            use_muon=None,
        )
        self._engine_options = dict(
            wire_dtype=wire_dtype,
            bucket_bytes=int(bucket_size_mb * 2**20),
            exchange=exchange,
            skip_nonfinite=skip_nonfinite,
            diagnostics_interval=diagnostics_interval,
            overlap=bool(overlap),
            ns_cuda_graphs=ns_cuda_graphs,
        )
        self._engine: Engine | None = None
        self._hook_handles: list = []
        self._unnamed_default: set[int] = set()  # ids of unnamed matrices routed to Muon by default
        self._stateless: list[Tensor] = []  # parameters without state (frozen at construction)
        super().__init__(params, defaults)
        self._engine = self._build_engine()
        self._register_hooks()
        self._report_routing([p for g in self.param_groups for p in g["params"]])

    def _register_hooks(self) -> None:
        self.register_state_dict_pre_hook(lambda optimizer: optimizer.flush())
        self.register_load_state_dict_pre_hook(lambda optimizer, state_dict: optimizer.flush())
        self.register_load_state_dict_post_hook(Muon._rebuild_after_load)

    # ---------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split ``param_group`` into its Muon part and its AdamW part, validate, and create state eagerly.

        Each part gets its own ``lr``: a Tensor lr already held by another group is cloned, so a scheduler
        that changes lr in place (ReduceLROnPlateau) changes each group once. Parameters with
        ``requires_grad=False`` get no state (see :meth:`step`).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        raw = param_group["params"]
        items = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(p[0], p[1]) if isinstance(p, tuple) else (None, p) for p in items]
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        validate_hyperparameters(group)
        offset = len(self._all_params())
        for i, (name, p) in enumerate(named):
            label = name or f"params[{offset + i}]"
            if not isinstance(p, Tensor):
                raise TypeError(f"parameter {label!r}: expected a Tensor, got {type(p).__name__}")
            if p.is_complex():
                raise ValueError(f"parameter {label!r}: complex parameters are not supported")
            if p.is_sparse:
                raise ValueError(f"parameter {label!r}: sparse parameters are not supported")
            if group["use_muon"] and p.ndim < 2:
                raise ValueError(f"parameter {label!r}: use_muon=True needs ≥2 dims, got shape {tuple(p.shape)}")
        added: list[Tensor] = []
        for use_muon in (True, False):
            part = [(n, p) for n, p in named if uses_muon(n, p, group["use_muon"]) == use_muon]
            if not part:
                continue
            sub = dict(param_group)
            sub["params"] = [(n, p) if n is not None else p for n, p in part]
            sub["use_muon"] = use_muon
            lr, weight_decay = group["lr"], group["weight_decay"]
            if not use_muon:
                lr = group["adamw_lr"] if group["adamw_lr"] is not None else lr
                weight_decay = group["adamw_weight_decay"] if group["adamw_weight_decay"] is not None else weight_decay
            if isinstance(lr, Tensor) and any(g["lr"] is lr for g in self.param_groups):
                lr = lr.clone()
            sub["lr"], sub["weight_decay"] = lr, weight_decay
            super().add_param_group(sub)
            for name, p in part:
                if p.requires_grad:
                    self.state[p] = self._fresh_state(p, use_muon)
                if use_muon and name is None and group["use_muon"] is None and p.ndim == 2:
                    self._unnamed_default.add(id(p))
                added.append(p)
        if self._engine is not None:
            self.flush()
            self._engine = self._build_engine()
            self._report_routing(added)

    @staticmethod
    def _fresh_state(p: Tensor, use_muon: bool) -> dict[str, Tensor]:
        return {"momentum_buffer": torch.zeros_like(p)} if use_muon else adamw_rule.init_state(p)

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _labelled(self) -> Iterator[tuple[str, Tensor, dict[str, Any]]]:
        """(label, parameter, group) in ``param_groups`` order; unnamed parameters are ``params[k]``, k their
        position in that order (after each user group is split into its Muon part and its AdamW part)."""
        k = 0
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for name, p in zip(names, group["params"]):
                yield name or f"params[{k}]", p, group
                k += 1

    def _build_engine(self) -> Engine:
        """The engine over the parameters that have state; those without (frozen) are listed in _stateless."""
        entries = []
        self._stateless = []
        for label, p, group in self._labelled():
            if not self.state.get(p):
                self._stateless.append(p)
                continue
            entries.append(Entry(len(entries), label, p, group, group["use_muon"], read_layout(label, p)))
        self._index_of_param = {id(e.param): e.index for e in entries}
        return Engine(entries, **self._engine_options)

    def _create_missing_state(self) -> bool:
        """Fresh state for every parameter that requires grad and has none; True when any was created."""
        created = False
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and not self.state.get(p):
                    self.state[p] = self._fresh_state(p, group["use_muon"])
                    created = True
        return created

    @staticmethod
    def _rebuild_after_load(optimizer: Muon) -> None:
        optimizer._create_missing_state()  # a checkpoint saved while a parameter was frozen
        optimizer._engine = optimizer._build_engine()

    def _report_routing(self, params: list[Tensor]) -> None:
        """Log where ``params`` go (INFO: one line per rule; DEBUG: one line per parameter) and warn when
        unnamed matrices routed to Muon look like an embedding or an output head."""
        chosen = {id(p) for p in params}
        rows = [(label, p, group) for label, p, group in self._labelled() if id(p) in chosen]
        if logger.isEnabledFor(logging.INFO):
            rules: dict[str, list[tuple[str, Tensor]]] = {"muon": [], "adamw": [], "frozen": []}
            for label, p, group in rows:
                rule = "frozen" if not self.state.get(p) else ("muon" if group["use_muon"] else "adamw")
                rules[rule].append((label, p))
            titles = {
                "muon": "muon",
                "adamw": "adamw",
                "frozen": "frozen (requires_grad=False, no state until it requires grad)",
            }
            for rule, members in rules.items():
                if members:
                    count = len(members)
                    numel = sum(p.numel() for _, p in members)
                    logger.info(
                        "Muon routing: %s: %d parameter%s (%s elements): %s",
                        titles[rule],
                        count,
                        "" if count == 1 else "s",
                        f"{numel:,}",
                        _name_patterns(members),
                    )
        if logger.isEnabledFor(logging.DEBUG):
            group_index = {id(g): i for i, g in enumerate(self.param_groups)}
            lines = [
                f"  {label}  {tuple(p.shape)}  {'muon' if group['use_muon'] else 'adamw'}"
                f"{'' if self.state.get(p) else ' (frozen)'}  group {group_index[id(group)]}"
                for label, p, group in rows
            ]
            logger.debug("Muon routing table (name, shape, rule, param group):\n%s", "\n".join(lines))
        candidates = [(label, p) for label, p, _ in rows if id(p) in self._unnamed_default]
        shapes = [tuple(p.shape) for p in self._all_params()]
        found = unnamed_lookalikes(candidates, shapes)
        if found:
            warnings.warn(
                f"Muon: parameters were given without names, so embeddings and output heads cannot be told from "
                f"hidden matrices: every matrix goes to Muon, and {', '.join(found)} look like an embedding table "
                "or an output head (long side > 4× the short one and the longest of any matrix), which belong to "
                "AdamW. Pass model.named_parameters() or dtensor_muon.muon_param_groups(model), or put them in a "
                'param group with "use_muon": False (or "use_muon": True to keep them on Muon without this warning).',
                UserWarning,
                stacklevel=3,
            )

    # ---------------------------------------------------------------- copies and checkpoints
    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` keep: torch's (defaults, state, param_groups) and the engine
        options; pending updates are applied first. The copy rebuilds its engine (and plans) from these."""
        self.flush()
        return {**super().__getstate__(), "_engine_options": self._engine_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Called by ``load_state_dict`` (state and param_groups only) and by copies (everything)."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("ns_algorithm", "auto")  # checkpoints from before the option existed
            if group.get("use_muon") is False:
                for p in group["params"]:
                    s = self.state.get(p)
                    if s and "step" in s and not torch.is_tensor(s["step"]):  # as torch.optim.AdamW does
                        s["step"] = adamw_rule.step_tensor(s["step"])
        if "_engine" not in self.__dict__:  # a copy: no engine, hooks or overlap attachment came with it
            self._hook_handles = []
            self._unnamed_default = set()
            self._engine = None
            self._engine = self._build_engine()
            self._register_hooks()

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step for every parameter with a gradient (on any rank). Returns the closure's loss.

        A parameter that had ``requires_grad=False`` when it was added has no state and no place in the
        plans; once it requires grad, its first step creates fresh state (as torch.optim.Muon/AdamW do for a
        parameter's first gradient) and rebuilds the plans. ``requires_grad`` must change on every rank alike.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self._engine is not None
        if self._engine.overlap and not self._hook_handles:
            raise RuntimeError(
                "overlap=True: call optimizer.attach(model) before the first step, so each module's update "
                "is applied before its next forward and before any state_dict()"
            )
        if any(p.requires_grad for p in self._stateless) and self._create_missing_state():
            self.flush()
            self._engine = self._build_engine()
        self._engine.step(self.state)
        return loss

    # ---------------------------------------------------------------- overlap
    def attach(self, *modules: torch.nn.Module) -> None:
        """Register the overlap hooks on ``modules`` (the model, or its parts): see :mod:`dtensor_muon.overlap`.

        Needed with ``overlap=True``; harmless without (every update is then applied inside ``step()``).
        """
        if not modules:
            raise ValueError("attach: give the model (or its parts) whose parameters this optimizer updates")
        # hooks name parameters by id, not by engine index, so they stay right when the engine is rebuilt
        # (add_param_group, a frozen parameter's first step); frozen Muon parameters are covered too
        key_of_param = {id(p): id(p) for g in self.param_groups if g["use_muon"] for p in g["params"]}
        self._hook_handles.extend(attach_hooks(modules, key_of_param, self._finish, self.flush))

    def detach(self) -> None:
        """Apply pending updates and remove the overlap hooks."""
        self.flush()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _finish(self, param_ids: list[int]) -> None:
        if self._engine is not None and self._engine.pending is not None:
            index_of = self._index_of_param
            with torch.no_grad():
                self._engine.finish([index_of[i] for i in param_ids if i in index_of])

    def flush(self) -> None:
        """Apply every pending update now (overlap mode); a no-op when nothing is pending."""
        if self._engine is not None:
            with torch.no_grad():
                self._engine.flush()

    @property
    def metrics(self) -> dict[str, float]:
        """Diagnostics of the last step (see :mod:`dtensor_muon.metrics` for the keys)."""
        return self._engine.metrics if self._engine is not None else {}

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank saw a non-finite gradient (``skip_nonfinite=True``)."""
        return self._engine.skipped_steps if self._engine is not None else 0

    @property
    def plans(self) -> list:
        """The per-mesh plans (owners, buckets, per-rank cost and bytes)."""
        return [w.plan for w in self._engine.meshes] if self._engine is not None else []
