"""``MatrixOptimizer``: the shared front end of every matrix optimizer (Muon, MOP, NorMuon).

A front end is a short subclass naming its rule (:mod:`dtensor_muon.rules`), its defaults and the checks of
its own hyperparameters; this base does the rest, for whole models on one device or over DTensors:

- param groups: each user group is split into a matrix-rule group (``"use_muon": True``) and an AdamW group
  (``"use_muon": False``, with ``lr``/``weight_decay`` from ``adamw_lr``/``adamw_weight_decay`` when given), so
  learning-rate schedulers scale both; each gets its own ``lr`` (a Tensor lr is cloned for the second);
- routing (:mod:`dtensor_muon.plan.routing`), logged at construction (logger ``dtensor_muon``), in the order the
  parameters were given; an unnamed parameter is ``param[i]``, its position in that order, in the log, warnings
  and errors. Unnamed 2-D matrices routed to the matrix rule by default raise a ``UserWarning`` (an output head
  cannot be recognized without names) unless a group given with ``"use_muon": False`` holds a matrix;
- matrix views (:mod:`dtensor_muon.plan.views`): a group's ``"matrix_split"`` or the ``matrix_splits`` keyword
  (``{name pattern: MatrixSplit}``, fnmatch patterns) cuts fused parameters into their matrices;
- state, created eagerly for every parameter that requires grad: the rule's shard state for matrix-rule
  parameters, ``step``/``exp_avg``/``exp_avg_sq`` for AdamW parameters, each in its parameter's layout, and the
  rule's owner state on the ranks that compute each matrix (see :mod:`dtensor_muon.engine.step`). A parameter with
  ``requires_grad=False`` gets no state and no place in the plans until it requires grad (then its first
  step creates fresh state, as torch's optimizers do);
- the engine (plans, transports, overlap) and checkpoints: ``copy.deepcopy`` and ``pickle`` give an
  optimizer that takes the same next step (its engine is rebuilt; overlap hooks are not copied: call
  ``attach`` on the copy); ``load_state_dict`` checks the state against this optimizer's rule, routing and
  this rank's layouts before loading anything (:func:`.state_loading.load_problem`), and
  :meth:`MatrixOptimizer.load_compatible_state` takes what carries over from another optimizer's state;
- param groups: a key that is neither an option of the optimizer nor torch's or a scheduler's raises.
"""

from __future__ import annotations

import fnmatch
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..distributed.host_memory import to_host
from ..distributed.layout import local, read_layout, tensor_parallel_blocks
from ..distributed.overlap import attach_hooks
from ..engine.context import OWNER_STATE_KEY, Entry
from ..engine.offload import OFFLOAD_MODES, offloaded_keys
from ..engine.step import EXCHANGE_MODES, Engine
from ..plan.routing import (
    caller_stacklevel,
    given_label,
    is_given_label,
    name_patterns,
    sequential_output_layer,
    unnamed_lookalikes,
    unnamed_matrices_warning,
    uses_muon,
    with_shape,
)
from ..plan.views import MatrixSplit
from ..rules import adamw as adamw_rule
from ..rules.base import MatrixRule
from ..rules.qk_clip import AttentionHeads
from . import state_loading
from .options import OPTIONS, TP_MODES
from .qk_clip import QKClip, scale_rows

logger = logging.getLogger("dtensor_muon")

ENGINE_KEYWORDS = tuple(dict.fromkeys(o.name for options in OPTIONS.values() for o in options if o.engine))
"""Engine-wide options (the table's ``engine`` ones): constructor keywords only, never param-group keys."""

TORCH_GROUP_KEYS = ("params", "param_names", "differentiable")
"""Group keys torch.optim.Optimizer itself handles: ``params``, ``param_names`` (from ``(name, tensor)``
pairs) and ``differentiable`` (``Optimizer.__setstate__`` puts it in ``defaults``; False only here)."""

GROUP_KEYS_SINCE_CHECKPOINTS = {"momentum_dtype": "float32"}
"""Group keys newer than checkpoints that exist, each with the value a group had before the key existed: a group
holds such a key only while it has another value (readers take that value where the key is absent). DCP's load
refuses a template key its checkpoint lacks, and torch's flattened optimizer state dict reads every key of the
live groups, so a group that always held the key could not load those checkpoints."""


def leave_out_old_values(group: dict[str, Any]) -> None:
    """Remove from ``group`` each key of :data:`GROUP_KEYS_SINCE_CHECKPOINTS` that holds its old value."""
    for key, old_value in GROUP_KEYS_SINCE_CHECKPOINTS.items():
        if key in group and group[key] == old_value:
            del group[key]


SCHEDULER_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
"""Keys torch's learning-rate schedulers (and SWALR) write into param groups for their own bookkeeping."""


def given_keywords(frame: dict[str, Any]) -> dict[str, Any]:
    """A front end's constructor keywords from its ``locals()`` taken first thing in ``__init__``: everything but
    ``self``, ``params`` and the ``__class__`` cell that ``super()`` adds."""
    return {k: v for k, v in frame.items() if k not in ("self", "params", "__class__")}


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``."""
    if not condition:
        raise ValueError(message)


def require_number(group: dict[str, Any], *keys: str) -> None:
    """Raise TypeError naming the first of ``keys`` whose value is not a number (a bool is not)."""
    for key in keys:
        value = group[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
            raise TypeError(f"{key} must be a number, got {type(value).__name__}")


def validate_common(group: dict[str, Any]) -> None:
    """Raise ValueError/TypeError naming the first bad hyperparameter shared by every matrix optimizer.

    Where torch.optim.Muon checks the same argument, the message carries torch's words after the name.
    """
    require_number(group, "lr", "weight_decay", "momentum", "adamw_eps")
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"lr: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    require(lr >= 0, f"lr: Learning rate should be >= 0 but is: {lr}")
    require(group["weight_decay"] >= 0, f"weight_decay: weight decay should be >= 0 but is: {group['weight_decay']}")
    require(group["momentum"] >= 0, f"momentum: momentum should be >= 0 but is: {group['momentum']}")
    require(group["momentum"] < 1, f"momentum: momentum should be < 1 but is: {group['momentum']}")
    betas = group["adamw_betas"]
    require(
        isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas),
        f"adamw_betas must be two numbers in [0, 1), got {betas!r}",
    )
    require(group["adamw_eps"] > 0, f"adamw_eps must be > 0, got {group['adamw_eps']}")
    for key in ("adamw_lr", "adamw_weight_decay"):
        value = group[key]
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(f"{key}: Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
        require(value is None or value >= 0, f"{key} must be None or >= 0, got {value}")
    require(
        group["use_muon"] in (None, True, False), f"use_muon must be None, True or False, got {group['use_muon']!r}"
    )
    split = group.get("matrix_split")
    require(
        split is None or isinstance(split, MatrixSplit),
        f"matrix_split must be None or a dtensor_muon.MatrixSplit, got {split!r}",
    )
    require(group["tp_mode"] in TP_MODES, f"tp_mode must be one of {TP_MODES}, got {group['tp_mode']!r}")


class MatrixOptimizer(torch.optim.Optimizer):
    """The shared front end (see the module docstring); subclasses set :attr:`rule` and validate their own keys."""

    rule: MatrixRule

    def __init__(
        self,
        params: Iterable[Any],
        keywords: dict[str, Any],
    ) -> None:
        """``keywords``: the front end's constructor keywords by name (:func:`given_keywords`), split here into the
        param-group defaults and the engine-wide options (:data:`ENGINE_KEYWORDS`, the options table's)."""
        defaults = {k: v for k, v in keywords.items() if k not in ENGINE_KEYWORDS}
        wire_dtype = keywords["wire_dtype"]
        bucket_size_mb = keywords["bucket_size_mb"]
        exchange = keywords["exchange"]
        diagnostics_interval = keywords["diagnostics_interval"]
        ns_cuda_graphs = keywords.get("ns_cuda_graphs", False)  # only Newton–Schulz has graphs
        lr = defaults["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError(f"lr: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        require(exchange in EXCHANGE_MODES, f"exchange must be one of {EXCHANGE_MODES}, got {exchange!r}")
        require(bucket_size_mb > 0, f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        require(
            isinstance(diagnostics_interval, int) and diagnostics_interval >= 0,
            f"diagnostics_interval must be an int >= 0, got {diagnostics_interval!r}",
        )
        require(
            wire_dtype is None or (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point),
            f"wire_dtype must be None or a floating dtype, got {wire_dtype!r}",
        )
        require(isinstance(ns_cuda_graphs, bool), f"ns_cuda_graphs must be a bool, got {ns_cuda_graphs!r}")
        offload = keywords["offload"]
        require(offload in OFFLOAD_MODES, f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        splits = dict(keywords["matrix_splits"] or {})
        for pattern, split in splits.items():
            require(
                isinstance(pattern, str) and isinstance(split, MatrixSplit),
                f"matrix_splits must map name patterns (str) to dtensor_muon.MatrixSplit, got {pattern!r}: {split!r}",
            )
        self._engine_options = dict(
            wire_dtype=wire_dtype,
            bucket_bytes=int(bucket_size_mb * 2**20),
            exchange=exchange,
            skip_nonfinite=keywords["skip_nonfinite"],
            diagnostics_interval=diagnostics_interval,
            overlap=bool(keywords["overlap"]),
            ns_cuda_graphs=ns_cuda_graphs,
            offload=offload,
        )
        self._matrix_splits = splits
        self._qk_clip = self._build_qk_clip(keywords)
        self._clip_after_update: dict[int, tuple[str, Tensor, Tensor]] = {}  # id(param) → its QK-clip, in flight
        self._engine: Engine | None = None
        self._hook_handles: list = []
        self._unnamed_default: set[int] = set()  # ids of unnamed matrices routed to the rule by default
        self._named_default: set[int] = set()  # ids of named 2-D matrices routed to the rule by default
        self._given_index: dict[int, int] = {}  # id(param) → its position among all the parameters given
        self._adamw_matrix_given = False  # a group given with "use_muon": False holds a ≥2-D parameter
        self._stateless: list[Tensor] = []  # parameters without state (frozen at construction)
        # this library's group options (torch adds "differentiable" to defaults on load: not one of them)
        self._option_keys = (*defaults, "use_muon", "matrix_split")
        super().__init__(params, {**defaults, "use_muon": None, "matrix_split": None})
        self._engine = self._build_engine()
        self._register_hooks()
        self._report_routing([p for g in self.param_groups for p in g["params"]])
        self._warn_offload_on_host()
        if self._qk_clip is not None:
            params = self._named_parameters()
            self._qk_clip.check_params(params)
            device = local(next(iter(params.values()))).device
            self._qk_clip.check_same_everywhere(device, f"{type(self).__name__}: QK-clip")

    def validate_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError/TypeError naming the first bad hyperparameter of the subclass's own keys."""

    @property
    def _offloaded(self) -> bool:
        return self._engine_options.get("offload", "none") == "host"

    def _warn_offload_on_host(self) -> None:
        """offload="host" with parameters in host memory: say that it saves nothing."""
        params = [p for p in self._all_params() if self.state.get(p)]
        if self._offloaded and params and local(params[0]).device.type == "cpu":
            warnings.warn(
                f"{type(self).__name__}: offload='host' keeps optimizer state in host memory while the parameters "
                "are on a GPU; these parameters are on the CPU, where the state is in host memory already, so it "
                "saves nothing (it only streams the state through copies)",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    def _offloaded_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state keys of ``group``'s parameters kept in host memory (none without ``offload="host"``)."""
        return offloaded_keys(self.rule, group) if self._offloaded else ()

    @staticmethod
    def _build_qk_clip(keywords: dict[str, Any]) -> QKClip | None:
        """The QK-clip of ``qk_clip_tau`` > 0 (checked with α and the heads), else None."""
        tau, alpha, heads = keywords["qk_clip_tau"], keywords["qk_clip_alpha"], keywords["qk_clip_heads"]
        require_number({"qk_clip_tau": tau, "qk_clip_alpha": alpha}, "qk_clip_tau", "qk_clip_alpha")
        require(tau >= 0, f"qk_clip_tau must be >= 0 (0: off), got {tau}")
        require(0 <= alpha <= 1, f"qk_clip_alpha must lie in [0, 1], got {alpha}")
        if tau == 0:
            require(heads is None, "qk_clip_heads is given but qk_clip_tau is 0 (off); set qk_clip_tau, e.g. 100")
            return None
        require(
            isinstance(heads, dict) and heads and all(isinstance(h, AttentionHeads) for h in heads.values()),
            f"qk_clip_tau = {tau} needs qk_clip_heads: {{layer name: dtensor_muon.AttentionHeads}}, got {heads!r}",
        )
        return QKClip(tau, alpha, heads)

    def record_max_logits(self, layer: str, max_logits: Tensor) -> None:
        """QK-clip: this rank's largest softmax input per head of attention ``layer`` (one value per head, the
        attention's scale included) in this step's forward passes; call it as often as there are passes."""
        if self._qk_clip is None:
            raise RuntimeError("record_max_logits: QK-clip is off; construct the optimizer with qk_clip_tau > 0")
        self._qk_clip.record(layer, max_logits)

    def _named_parameters(self) -> dict[str, Tensor]:
        return {label: p for label, p, _ in self._labelled()}

    def _register_hooks(self) -> None:
        self.register_state_dict_pre_hook(lambda optimizer: optimizer.flush())
        self.register_load_state_dict_pre_hook(lambda optimizer, state_dict: optimizer.flush())
        self.register_load_state_dict_pre_hook(MatrixOptimizer._check_loaded_state)
        self.register_load_state_dict_pre_hook(MatrixOptimizer._keep_owner_state_uncast)
        self.register_load_state_dict_pre_hook(MatrixOptimizer._keep_momentum_uncast)
        self.register_load_state_dict_post_hook(MatrixOptimizer._rebuild_after_load)

    # ---------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split ``param_group`` into its matrix-rule part and its AdamW part, validate, and create state eagerly.

        Each part gets its own ``lr``: a Tensor lr already held by another group is cloned, so a scheduler
        that changes lr in place (ReduceLROnPlateau) changes each group once. Parameters with
        ``requires_grad=False`` get no state (see :meth:`step`).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        self._check_group_keys(param_group)
        raw = param_group["params"]
        items = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(p[0], p[1]) if isinstance(p, tuple) else (None, p) for p in items]
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        validate_common(group)
        self.validate_group(group)
        offset = len(self._all_params())
        for i, (name, p) in enumerate(named):
            label = name or given_label(offset + i)
            if not isinstance(p, Tensor):
                raise TypeError(f"parameter {label!r}: expected a Tensor, got {type(p).__name__}")
            if p.is_complex():
                raise ValueError(f"parameter {label!r}: complex parameters are not supported")
            if p.is_sparse:
                raise ValueError(f"parameter {label!r}: sparse parameters are not supported")
            if group["use_muon"] and p.ndim < 2:
                raise ValueError(f"parameter {label!r}: use_muon=True needs ≥2 dims, got shape {tuple(p.shape)}")
        added: list[Tensor] = []
        position = {id(p): offset + i for i, (_, p) in enumerate(named)}
        if group["use_muon"] is False and any(p.ndim >= 2 for _, p in named):
            self._adamw_matrix_given = True
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
            leave_out_old_values(self.param_groups[-1])
            for name, p in part:
                self._given_index[id(p)] = position[id(p)]
                if p.requires_grad:
                    self.state[p] = self._fresh_state(p, self.param_groups[-1], name or given_label(position[id(p)]))
                if use_muon and group["use_muon"] is None and p.ndim == 2:
                    (self._unnamed_default if name is None else self._named_default).add(id(p))
                added.append(p)
        if self._engine is not None:
            self.flush()
            self._engine = self._build_engine()
            self._report_routing(added)

    def _check_group_keys(self, param_group: dict[str, Any]) -> None:
        """Raise ValueError naming the first key of ``param_group`` that is no option of this optimizer."""
        me = type(self).__name__
        valid = (*self._option_keys, *TORCH_GROUP_KEYS, *SCHEDULER_GROUP_KEYS)
        require("params" in param_group, f"{me}: a param group needs a 'params' key, got keys {sorted(param_group)}")
        for key in param_group:
            if key in valid:
                continue
            listed = ", ".join(sorted(valid))
            if key in ENGINE_KEYWORDS and self._takes_keyword(key):
                raise ValueError(
                    f"{me}: param group key {key!r} is a constructor keyword, one setting for the whole optimizer: "
                    f"pass {me}(..., {key}=...) instead. Valid param group keys: {listed}"
                )
            raise ValueError(f"{me}: unknown param group key {key!r}. Valid param group keys: {listed}")
        require(
            not param_group.get("differentiable", False),
            f"{me}: differentiable=True is not supported (the step runs under torch.no_grad)",
        )

    def _takes_keyword(self, key: str) -> bool:
        """Whether this front end's constructor (or one it forwards to) has the keyword ``key``."""
        return any(
            key in inspect.signature(cls.__init__).parameters
            for cls in type(self).__mro__
            if "__init__" in cls.__dict__ and issubclass(cls, MatrixOptimizer) and cls is not MatrixOptimizer
        )

    def _fresh_state(self, p: Tensor, group: dict[str, Any], label: str) -> dict[str, Tensor]:
        """Fresh state of parameter ``label`` of ``group``: the rule's shard state or AdamW's, its offloaded
        tensors moved to host memory one parameter at a time."""
        state = self.rule.init_shard_state(p, group, label) if group["use_muon"] else adamw_rule.init_state(p)
        keys = self._offloaded_keys(group)
        return {key: to_host(t) if key in keys else t for key, t in state.items()}

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _labelled(self) -> Iterator[tuple[str, Tensor, dict[str, Any]]]:
        """(label, parameter, group) in ``param_groups`` order; an unnamed parameter's label is ``param[i]``, i its
        position among the parameters given (:func:`.routing.given_label`), whichever part of its group's split
        (matrix rule or AdamW) it landed in."""
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for name, p in zip(names, group["params"]):
                yield name or given_label(self._given_index[id(p)]), p, group

    def _build_engine(self, loaded_owner_state: set[int] | None = None) -> Engine:
        """The engine over the parameters that have state; those without (frozen) are listed in _stateless.

        ``loaded_owner_state``: ids of the parameters whose owner state was just loaded (each must hold every
        matrix this rank computes).
        """
        entries = []
        self._stateless = []
        for label, p, group in self._labelled():
            if not self.state.get(p):
                self._stateless.append(p)
                continue
            split = self._split_of(label, p, group) if group["use_muon"] else None
            entries.append(Entry(len(entries), label, p, group, group["use_muon"], read_layout(label, p), split))
        self._index_of_param = {id(e.param): e.index for e in entries}
        return Engine(
            self.rule, entries, self.state, loaded_owner_state=loaded_owner_state or set(), **self._engine_options
        )

    def _create_missing_state(self) -> bool:
        """Fresh state for every parameter that requires grad and has none; True when any was created."""
        created = False
        for label, p, group in list(self._labelled()):
            if p.requires_grad and not self.state.get(p):
                self.state[p] = self._fresh_state(p, group, label)
                created = True
        return created

    def _split_of(self, label: str, p: Tensor, group: dict[str, Any]) -> MatrixSplit | None:
        """The group's ``matrix_split``, else the first ``matrix_splits`` pattern matching ``label``; with
        ``tp_mode="blockwise"``, the tensor-parallel blocks (:func:`~dtensor_muon.distributed.layout.tensor_parallel_blocks`)."""
        split = group.get("matrix_split")
        if split is None:
            split = next((s for pattern, s in self._matrix_splits.items() if fnmatch.fnmatchcase(label, pattern)), None)
        if group["tp_mode"] != "blockwise":
            return split
        blocks = tensor_parallel_blocks(p)
        if blocks is None:
            return split
        if split is not None:
            raise ValueError(
                f"parameter {label!r}: tp_mode='blockwise' cuts it into its tensor-parallel blocks; it also has "
                f"the matrix split {split}: use one of the two"
            )
        dim, lengths = blocks
        if p.ndim == 3 and dim == 0:
            return None  # experts split over TP ranks: each rank's experts are whole matrices already
        return MatrixSplit(dim, sizes=lengths)

    # ---------------------------------------------------------------- loading state
    @staticmethod
    def _check_loaded_state(optimizer: MatrixOptimizer, state_dict: dict[str, Any]) -> None:
        """Raise ValueError before anything is loaded when ``state_dict`` does not fit this optimizer: another
        optimizer's or another routing's state, or another world size's shards
        (:func:`.state_loading.load_problem`). The ranks of each mesh agree first, so every rank raises (none
        waits in the engine's collectives)."""
        problem = state_loading.agree(optimizer, state_loading.load_problem(optimizer, state_dict))
        if problem is not None:
            raise ValueError(problem)

    def load_compatible_state(self, state_dict: dict[str, Any]) -> dict[str, list[str]]:
        """Start from another optimizer's state: keep the AdamW moments of this optimizer's AdamW parameters,
        start everything else fresh (:func:`.state_loading.load_compatible_state` says how). Returns (and logs
        at INFO) ``{"kept": [...], "fresh": [...]}``, parameter names."""
        return state_loading.load_compatible_state(self, state_dict)

    @staticmethod
    def _keep_owner_state_uncast(optimizer: MatrixOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Take owner state out of a state dict before torch casts its tensors to the parameter's dtype and
        device; :meth:`_rebuild_after_load` puts it back (moved to the device, the rule's host entries to the host, dtype
        kept)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        param_of = dict(zip(saved_ids, optimizer._all_params()))  # as torch's load_state_dict maps them
        state = dict(state_dict["state"])
        optimizer._loaded_owner_state = []
        for key, value in state.items():
            if isinstance(value, dict) and OWNER_STATE_KEY in value and key in param_of:
                value = dict(value)
                optimizer._loaded_owner_state.append((param_of[key], value.pop(OWNER_STATE_KEY)))
                state[key] = value
        return {**state_dict, "state": state}

    @staticmethod
    def _keep_momentum_uncast(optimizer: MatrixOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Take a low-precision momentum's tensors out of a state dict before torch casts them to the parameter's
        dtype; :meth:`_rebuild_after_load` puts them back (:func:`.state_loading.hold_uncast`)."""
        state_dict, optimizer._loaded_momentum = state_loading.hold_uncast(optimizer, state_dict)
        return state_dict

    @staticmethod
    def _rebuild_after_load(optimizer: MatrixOptimizer) -> None:
        state_loading.restore_uncast(optimizer, optimizer.__dict__.pop("_loaded_momentum", []))
        loaded = optimizer.__dict__.pop("_loaded_owner_state", [])
        host = optimizer.rule.host_owner_state_keys
        for p, held in loaded:
            device = local(p).device
            optimizer.state[p][OWNER_STATE_KEY] = {
                matrix: {name: t.to("cpu" if name in host else device) for name, t in tensors.items()}
                for matrix, tensors in held.items()
            }
        optimizer._create_missing_state()  # a checkpoint saved while a parameter was frozen
        optimizer._engine = optimizer._build_engine(loaded_owner_state={id(p) for p, _ in loaded})

    def _report_routing(self, params: list[Tensor]) -> None:
        """Log where ``params`` go, in the order they were given (INFO: one line per rule; DEBUG: one line per
        parameter), and warn when unnamed matrices go to the matrix rule by default (an output head cannot be
        recognized) or the last layer of an ``nn.Sequential`` model does (each warning points at the caller's
        line). Unnamed parameters appear as ``param[i] (shape)``."""
        chosen = {id(p) for p in params}
        rows = sorted(
            ((label, p, group) for label, p, group in self._labelled() if id(p) in chosen),
            key=lambda row: self._given_index[id(row[1])],
        )
        if logger.isEnabledFor(logging.INFO):
            me, rule_name = type(self).__name__, self.rule.name
            rules: dict[str, list[tuple[str, Tensor]]] = {rule_name: [], "adamw": [], "frozen": []}
            for label, p, group in rows:
                rule = "frozen" if not self.state.get(p) else (rule_name if group["use_muon"] else "adamw")
                rules[rule].append((with_shape(label, p) if is_given_label(label) else label, p))
            titles = {
                rule_name: rule_name if me.lower() == rule_name else f"{me} ({rule_name} rule)",
                "adamw": "adamw",
                "frozen": "frozen (requires_grad=False, no state until it requires grad)",
            }
            for rule, members in rules.items():
                if members:
                    count = len(members)
                    numel = sum(p.numel() for _, p in members)
                    logger.info(
                        "%s routing: %s: %d parameter%s (%s elements): %s",
                        me,
                        titles[rule],
                        count,
                        "" if count == 1 else "s",
                        f"{numel:,}",
                        name_patterns(members),
                    )
        if logger.isEnabledFor(logging.DEBUG):
            group_index = {id(g): i for i, g in enumerate(self.param_groups)}
            lines = [
                f"  {label}  {tuple(p.shape)}  {self.rule.name if group['use_muon'] else 'adamw'}"
                f"{'' if self.state.get(p) else ' (frozen)'}  group {group_index[id(group)]}"
                for label, p, group in rows
            ]
            logger.debug(
                "%s routing table (name, shape, rule, param group):\n%s", type(self).__name__, "\n".join(lines)
            )
        candidates = [(label, p) for label, p, _ in rows if id(p) in self._unnamed_default]
        if candidates and not self._adamw_matrix_given:
            found = unnamed_lookalikes(candidates, [tuple(p.shape) for p in self._all_params()])
            warnings.warn(
                unnamed_matrices_warning(type(self).__name__, [with_shape(label, p) for label, p in candidates], found),
                UserWarning,
                stacklevel=caller_stacklevel(),
            )
        last = sequential_output_layer([(label, p) for label, p, _ in self._labelled()])
        if last is not None and id(last[1]) in self._named_default and id(last[1]) in chosen:
            me, (label, p) = type(self).__name__, last
            warnings.warn(
                f"{me}: {with_shape(label, p)} is the last layer of an nn.Sequential (its name is positions only) "
                f"and goes to {me}. "
                "If it is the output layer (the classifier or head feeding the loss), it belongs to AdamW: build the "
                "groups with dtensor_muon.muon_param_groups(model), which routes a Sequential's last Linear to "
                f'AdamW, or put it in a param group with "use_muon": False ("use_muon": True keeps it on {me} '
                "without this warning).",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    # ---------------------------------------------------------------- copies and checkpoints
    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` keep: torch's (defaults, state, param_groups) and the engine
        options; pending updates are applied first. The copy rebuilds its engine (and plans) from these."""
        self.flush()
        return {
            **super().__getstate__(),
            "_engine_options": self._engine_options,
            "_matrix_splits": self._matrix_splits,
            "_option_keys": self._option_keys,
            "_qk_clip": self._qk_clip,
            "_given_positions": [self._given_index[id(p)] for p in self._all_params()],
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Called by ``load_state_dict`` (state and param_groups only) and by copies (everything)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_qk_clip", None)  # pickled before QK-clip existed
        self._clip_after_update = {}  # flushed before any pickle or state_dict
        if "_option_keys" not in self.__dict__:  # pickled before the option keys were recorded
            self._option_keys = tuple(key for key in self.defaults if key != "differentiable")
        if "differentiable" not in self._option_keys:
            # torch.optim.Optimizer.__setstate__ adds it; torch's own optimizers have it from construction, this
            # one never does: without it, defaults (and groups added later) stay as constructed
            self.defaults.pop("differentiable", None)
        for group in self.param_groups:
            leave_out_old_values(group)
            for key in self._option_keys:  # checkpoints from before one of this library's options existed
                if key not in GROUP_KEYS_SINCE_CHECKPOINTS:  # absent: the old value, see there
                    group.setdefault(key, self.defaults[key])
            if group.get("use_muon") is False:
                for p in group["params"]:
                    s = self.state.get(p)
                    if s and "step" in s and not torch.is_tensor(s["step"]):  # as torch.optim.AdamW does
                        s["step"] = adamw_rule.step_tensor(s["step"])
        if "_engine" not in self.__dict__:  # a copy: no engine, hooks or overlap attachment came with it
            self._hook_handles = []
            self._unnamed_default = set()
            self._named_default = set()
            self._adamw_matrix_given = False
            params = self._all_params()
            positions = self.__dict__.pop("_given_positions", None) or range(len(params))  # None: pickled before
            self._given_index = {id(p): i for p, i in zip(params, positions)}
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
        skipped = self.skipped_steps
        if self._qk_clip is not None:
            self._qk_clip.reduce(local(next(iter(self._named_parameters().values()))).device)
        self._engine.step()
        if self._qk_clip is not None:
            self._clip_qk(skipped=self.skipped_steps > skipped)
        return loss

    def _clip_qk(self, skipped: bool) -> None:
        """QK-clip after the step's update: scale each clipped weight's rows now, or, while its update is still
        in flight (overlap), as soon as it lands (:meth:`_finish`, :meth:`flush`)."""
        assert self._qk_clip is not None and self._engine is not None
        params = self._named_parameters()
        pending = self._engine.pending.remaining if self._engine.pending is not None else {}
        for name, factors in self._qk_clip.row_factors(params, skipped).items():
            p = params[name]
            if self._index_of_param.get(id(p)) in pending:
                self._clip_after_update[id(p)] = (name, p, factors)
            else:
                scale_rows(name, p, factors)

    def _apply_waiting_clips(self, param_ids: Iterable[int] | None = None) -> None:
        """Scale the rows of the weights whose updates have landed (``param_ids``; None: all that wait)."""
        pending = self._engine.pending.remaining if self._engine is not None and self._engine.pending else {}
        for i in list(self._clip_after_update if param_ids is None else param_ids):
            if i in self._clip_after_update and self._index_of_param.get(i) not in pending:
                scale_rows(*self._clip_after_update.pop(i))

    # ---------------------------------------------------------------- overlap
    def attach(self, *modules: torch.nn.Module) -> None:
        """Register the overlap hooks on ``modules`` (the model, or its parts): see :mod:`dtensor_muon.distributed.overlap`.

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

    def _finish(self, param_ids: list[int]) -> bool:
        """Apply the pending updates of these parameters (by ``id``); whether any was applied."""
        if self._engine is None or self._engine.pending is None:
            return False
        index_of = self._index_of_param
        with torch.no_grad():
            applied = self._engine.finish([index_of[i] for i in param_ids if i in index_of])
        if applied and self._clip_after_update:
            self._apply_waiting_clips(param_ids)
        return applied

    def flush(self) -> None:
        """Apply every pending update now (overlap mode), and with ``offload="host"`` wait until the state has
        reached host memory; a no-op when nothing is pending."""
        if self._engine is not None:
            with torch.no_grad():
                self._engine.flush()
            self._engine.settle()
        if self._clip_after_update:
            self._apply_waiting_clips()

    @property
    def metrics(self) -> dict[str, float]:
        """Diagnostics of the last step (see :mod:`dtensor_muon.engine.metrics` for the keys)."""
        metrics = self._engine.metrics if self._engine is not None else {}
        return {**metrics, **self._qk_clip.metrics} if self._qk_clip is not None else metrics

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank saw a non-finite gradient (``skip_nonfinite=True``)."""
        return self._engine.skipped_steps if self._engine is not None else 0

    @property
    def plans(self) -> list:
        """The per-mesh plans (owners, buckets, per-rank cost and bytes)."""
        return [w.plan for w in self._engine.meshes] if self._engine is not None else []
