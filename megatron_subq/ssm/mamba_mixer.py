"""``SubqMambaMixer``: megatron-core's Mamba-2 mixer in plain PyTorch, for where ``mamba_ssm``'s
Triton kernels (and ``causal_conv1d``'s CUDA ones) are missing: the CPU (CI) and GPUs without them.

It is a drop-in for ``megatron.core.ssm.mamba_mixer.MambaMixer`` in a ``MambaLayerSubmodules``
spec: the same constructor, the same parameter names, shapes, dtypes and TP layout, the same
``sharded_state_dict`` keys, and the same math (``megatron_subq.ops.mamba2``):

    [z | x | B | C | dt] = in_proj(h)                         column-parallel, per TP rank
    [x | B | C] = silu(causal depthwise conv1d([x | B | C]))  conv1d: [channels, 1, d_conv]
    y = SSD(x, dt + dt_bias, A = -exp(A_log), B, C) + D * x     chunked scan, fp32
    y = RMSNorm over groups (y * silu(z)) * norm.weight          norm_before_gate=False, eps 1e-5
    out = out_proj(y)                                            row-parallel

TP: rank r holds heads [r*H/N, (r+1)*H/N) and groups [r*G/N, (r+1)*G/N); its in_proj rows are
[z_r | x_r | B_r | C_r | dt_r] and its conv channels [x_r | B_r | C_r]. Under sequence
parallelism in_proj all-gathers the sequence and out_proj reduce-scatters it (megatron's linears).

Context parallelism (``pg_collection.cp`` of N > 1 ranks; megatron's scheme, through its
``MambaContextParallel``): the rank's zig-zag sequence share of in_proj's output is exchanged
all-to-all for its share of the TP rank's heads (and groups, replicated when fewer than N) over
the whole sequence in natural order, the conv1d and the scan run on that with the matching slices
of conv1d / dt_bias / A_log / D, and the scan's output goes back to the sequence share, where
the gate (z, never exchanged back) and the norm apply. Heads per TP rank must be divisible by N.
Not supported (a ValueError names each): packed sequences, inference under context parallelism,
dynamic-batching inference; megatron's ``MambaMixer`` takes them (``mamba_mixer_class`` chooses).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules, _split_tensor_factory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                             make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)
from megatron.core.utils import deprecate_inference_params, get_pg_rank, get_pg_size

from ..ops.mamba2 import (causal_conv1d, causal_conv1d_step, gated_rms_norm, ssd_chunk,
                          ssd_step)
from ..parallel import process_groups

__all__ = ["GatedRMSNorm", "MambaMixerSubmodules", "SubqMambaMixer"]


class GatedRMSNorm(nn.Module):
    """``norm(x * silu(z)) * weight`` over groups of ``group_size`` channels (mamba_ssm's
    ``RMSNormGated``; same parameter: ``weight`` of ones, no bias)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gated_rms_norm(x, self.weight, z, group_size=self.group_size, eps=self.eps,
                              norm_before_gate=self.norm_before_gate)


def _rank_rows(full: torch.Tensor, sizes, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of every component of ``full`` (dim 0 = the concatenated
    components of ``sizes``), concatenated: [c0_r | c1_r | ...]."""
    parts, start = [], 0
    for size in sizes:
        local = size // tp
        parts.append(full[start + rank * local:start + (rank + 1) * local])
        start += size
    return torch.cat(parts, dim=0)


def _mark_tp(param: torch.Tensor) -> torch.Tensor:
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    return param


class SubqMambaMixer(MegatronModule):
    """Mamba-2 mixer with megatron's ``MambaMixer`` interface and parameters, in plain PyTorch.

    Arguments as megatron's ``MambaMixer`` (0.16.1); sizes come from the config
    (``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups``, ``mamba_num_heads`` or
    ``expand * d_model / mamba_head_dim`` heads); ``d_state``/``headdim``/``ngroups``/
    ``use_mem_eff_path`` are deprecated there and ignored here alike (with a warning), and so are
    ``dt_init``/``dt_scale`` (megatron ignores them too). ``pg_collection`` gives ``tp`` and
    ``cp`` (context parallelism: see the module docstring); None falls back to megatron's global
    groups. Under CP every rank keeps the TP rank's whole parameters; the per-head ones get
    gradient only from the rank's slice, summed by megatron's DP x CP gradient reduction.

    Initialisation (megatron's scheme; identical weights at any TP size): every parameter is
    drawn as the full TP=1 tensor from the default CPU generator and each rank keeps its share,
    component by component. ``conv1d``: kaiming-uniform (a=sqrt(5)), or U(-conv_init, conv_init),
    bias as ``nn.Conv1d``'s default; ``dt_bias`` = softplus^-1(dt), dt log-uniform in
    [dt_min, dt_max] floored at dt_init_floor; ``A_log`` = log U(A_init_range) (zeros without
    ``config.perform_initialization``); ``D`` = 1; ``norm.weight`` = 1; ``in_proj``/``out_proj``
    by the config's init methods. megatron's ``ColumnParallelLinear`` (with
    ``use_cpu_initialization``) splits its master into *contiguous* row blocks, not per
    component; so at TP > 1 the same master is drawn again here (the CPU generator is rewound to
    just before in_proj's draw and left where in_proj left it) and each rank's rows are replaced
    by its [z_r | x_r | B_r | C_r | dt_r] share of it. Without ``use_cpu_initialization`` the
    linears initialise their shards on the device, as megatron's do.
    """

    def __init__(self, config, submodules: MambaMixerSubmodules, d_model, d_conv=4,
                 conv_init=None, expand=2, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True,
                 norm_before_gate=False, dt_min=0.001, dt_max=0.1, dt_init="random",
                 dt_scale=1.0, dt_init_floor=1e-4, bias=False, conv_bias=True, chunk_size=128,
                 layer_number=None, use_mem_eff_path=None, d_state=None, headdim=None,
                 ngroups=None, pg_collection=None, pp_layer_offset: int = 0):
        super().__init__(config)
        for arg, value, field in (("use_mem_eff_path", use_mem_eff_path, "use_mamba_mem_eff_path"),
                                  ("d_state", d_state, "mamba_state_dim"),
                                  ("headdim", headdim, "mamba_head_dim"),
                                  ("ngroups", ngroups, "mamba_num_groups")):
            if value is not None:
                warnings.warn(f"SubqMambaMixer: the '{arg}' argument is deprecated (as in "
                              f"megatron's MambaMixer) and ignored; config.{field} is used",
                              DeprecationWarning, stacklevel=2)
        self.pg_collection = process_groups(pg_collection)
        self.tp_group = self.pg_collection.tp
        tp, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)

        self.d_model = d_model
        self.d_conv = d_conv
        self.conv_init = conv_init
        self.expand = expand
        self.D_has_hdim = D_has_hdim
        self.rmsnorm = rmsnorm
        self.norm_before_gate = norm_before_gate
        self.chunk_size = chunk_size
        self.layer_number = layer_number
        self.pp_layer_offset = pp_layer_offset
        self.cached_batch_size = None
        self.activation = "silu"
        self.d_state = config.mamba_state_dim
        self.headdim = config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        self._check_arguments(config, tp, A_init_range, dt_min, dt_max, bias)
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = int(expand * d_model)
            self.nheads = self.d_inner // self.headdim
        self.nheads_local_tp = self.nheads // tp
        self.d_inner_local_tp = self.d_inner // tp
        self.ngroups_local_tp = self.ngroups // tp
        gn = self.ngroups * self.d_state
        in_sizes = [self.d_inner, self.d_inner, gn, gn, self.nheads]       # z x B C dt
        conv_sizes = [self.d_inner, gn, gn]                                # x B C

        rng_before_in_proj = torch.get_rng_state()
        self.in_proj = build_module(
            submodules.in_proj, d_model, sum(in_sizes), config=config,
            init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group)
        self._component_wise_in_proj(rng_before_in_proj, in_sizes, tp, rank)
        weight = getattr(self.in_proj, "weight", None)
        # our parameters live where in_proj's weight does (CPU with use_cpu_initialization)
        device = weight.device if isinstance(weight, torch.Tensor) else torch.empty(0).device
        dtype = config.params_dtype

        # conv1d: depthwise over this rank's [x_r | B_r | C_r]; the full TP=1 tensors drawn first
        conv_full = sum(conv_sizes)
        conv_weight = torch.empty(conv_full, 1, d_conv, dtype=torch.float32)
        if conv_init is not None:
            nn.init.uniform_(conv_weight, -conv_init, conv_init)
        else:
            nn.init.kaiming_uniform_(conv_weight, a=math.sqrt(5))
        conv_bias_full = None
        if conv_bias:  # nn.Conv1d's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = d_conv
            bound = 1.0 / math.sqrt(d_conv)
            conv_bias_full = torch.empty(conv_full, dtype=torch.float32).uniform_(-bound, bound)
        conv_dim = conv_full // tp
        self.conv1d = nn.utils.skip_init(
            nn.Conv1d, in_channels=conv_dim, out_channels=conv_dim, bias=conv_bias,
            kernel_size=d_conv, groups=conv_dim, padding=d_conv - 1, device=device, dtype=dtype)
        with torch.no_grad():
            self.conv1d.weight.copy_(_rank_rows(conv_weight, conv_sizes, tp, rank))
            _mark_tp(self.conv1d.weight)
            if conv_bias:
                self.conv1d.bias.copy_(_rank_rows(conv_bias_full, conv_sizes, tp, rank))
                _mark_tp(self.conv1d.bias)

        heads = slice(rank * self.nheads_local_tp, (rank + 1) * self.nheads_local_tp)
        # dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max], floored
        dt = torch.exp(torch.rand(self.nheads, dtype=torch.float32)
                       * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        self.dt_bias = _mark_tp(nn.Parameter(inv_dt[heads].to(device=device, dtype=dtype).clone()))
        A = torch.ones(self.nheads, dtype=torch.float32)
        if config.perform_initialization:
            A.uniform_(*A_init_range)
        self.A_log = _mark_tp(nn.Parameter(torch.log(A[heads]).to(device).clone()))  # fp32
        D_local = self.d_inner_local_tp if D_has_hdim else self.nheads_local_tp
        self.D = _mark_tp(nn.Parameter(torch.ones(D_local, dtype=torch.float32, device=device)))

        if rmsnorm:
            self.norm = GatedRMSNorm(self.d_inner_local_tp, eps=1e-5,
                                     group_size=self.d_inner_local_tp // self.ngroups_local_tp,
                                     norm_before_gate=norm_before_gate, device=device, dtype=dtype)
            _mark_tp(self.norm.weight)

        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, d_model, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=self.tp_group)
        # context parallelism: megatron's exchange and parameter slicing (no parameters of its
        # own; it slices ours in the forward, so gradients reach them); None at CP=1
        cp_group = getattr(self.pg_collection, "cp", None)
        self.cp = None
        if get_pg_size(cp_group) > 1:
            self.cp = MambaContextParallel(
                cp_group, self.d_inner_local_tp, self.nheads_local_tp, self.ngroups_local_tp,
                self.d_state, self.conv1d, self.dt_bias, self.A_log, self.D, D_has_hdim)

    # ---------------------------------------------------------------------------- construction
    def _check_arguments(self, config, tp, A_init_range, dt_min, dt_max, bias):
        """Every refusal before anything is allocated: a ValueError naming the field/argument."""
        def bad(name, value, allowed):
            raise ValueError(f"SubqMambaMixer: {name}={value!r} is invalid: allowed {allowed}")

        def positive_int(x):
            return isinstance(x, int) and not isinstance(x, bool) and x > 0

        for field in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            if not positive_int(getattr(config, field)):
                bad(field, getattr(config, field), "an integer >= 1")
        if config.mamba_num_heads is not None:
            if not positive_int(config.mamba_num_heads):
                bad("mamba_num_heads", config.mamba_num_heads, "None or an integer >= 1")
            nheads = config.mamba_num_heads
        else:
            d_inner = int(self.expand * self.d_model)
            if d_inner <= 0 or d_inner % self.headdim:
                bad("expand * hidden_size", d_inner,
                    f"a positive multiple of mamba_head_dim={self.headdim} (or set "
                    "mamba_num_heads)")
            nheads = d_inner // self.headdim
        if nheads % tp:
            bad("mamba_num_heads", nheads,
                f"a multiple of tensor_model_parallel_size={tp} (each rank holds whole heads)")
        if self.ngroups % tp:
            bad("mamba_num_groups", self.ngroups,
                f"a multiple of tensor_model_parallel_size={tp} (each rank holds whole groups)")
        if nheads % self.ngroups:
            bad("mamba_num_groups", self.ngroups, f"a divisor of mamba_num_heads={nheads}")
        cp = get_pg_size(getattr(self.pg_collection, "cp", None))
        heads_tp, groups_tp = nheads // tp, self.ngroups // tp
        if cp > 1 and heads_tp % cp:
            bad("context_parallel_size", cp,
                f"(--context-parallel-size) a divisor of the Mamba heads per tensor-parallel "
                f"rank ({nheads} / {tp} = {heads_tp}): each CP rank scans a share of them")
        if cp > 1 and groups_tp % cp and cp % groups_tp:
            bad("context_parallel_size", cp,
                f"(--context-parallel-size) a divisor or a multiple of the Mamba groups per "
                f"tensor-parallel rank (mamba_num_groups={self.ngroups} / {tp} = {groups_tp}): "
                "groups are split or replicated over CP")
        if bias:
            bad("bias", bias, "False (as megatron's MambaMixer)")
        if self.norm_before_gate:
            bad("norm_before_gate", self.norm_before_gate, "False (as megatron's MambaMixer)")
        if not (len(A_init_range) == 2 and 0 < A_init_range[0] <= A_init_range[1]):
            bad("A_init_range", A_init_range, "(lo, hi) with 0 < lo <= hi")
        if not 0 < dt_min <= dt_max:
            bad("dt_min, dt_max", (dt_min, dt_max), "0 < dt_min <= dt_max")
        if not positive_int(self.d_conv):
            bad("d_conv", self.d_conv, "an integer >= 1")
        if not positive_int(self.chunk_size):
            bad("chunk_size", self.chunk_size, "an integer >= 1")

    def _component_wise_in_proj(self, rng_before, sizes, tp: int, rank: int) -> None:
        """Give this rank the [z_r | x_r | B_r | C_r | dt_r] rows of the TP=1 master in_proj
        weight (see the class docstring); a no-op at TP=1, without CPU initialisation, or for an
        in_proj whose rows are not ColumnParallelLinear's contiguous share of that master (then
        warned)."""
        config = self.config
        weight = getattr(self.in_proj, "weight", None)
        if (tp == 1 or not (config.use_cpu_initialization and config.perform_initialization)
                or not isinstance(weight, torch.Tensor) or weight.is_meta):
            return
        rng_after = torch.get_rng_state()
        torch.set_rng_state(rng_before)
        try:
            master = torch.empty(sum(sizes), self.d_model, dtype=torch.float32)
            config.init_method(master)
            master = master.to(config.params_dtype)
        finally:
            torch.set_rng_state(rng_after)
        rows = weight.shape[0]
        if not torch.equal(master[rank * rows:(rank + 1) * rows], weight.detach().cpu()):
            warnings.warn(f"SubqMambaMixer: in_proj ({type(self.in_proj).__name__}) did not draw "
                          "the expected CPU master; its TP shards are kept as initialised",
                          RuntimeWarning, stacklevel=3)
            return
        with torch.no_grad():
            weight.copy_(_rank_rows(master, sizes, tp, rank))

    # ---------------------------------------------------------------------------- forward
    def forward(self, hidden_states, inference_context=None, *, inference_params=None,
                packed_seq_params=None):
        """hidden_states [s, b, d_model] (s/tp under sequence parallelism) -> (out, out_bias)
        as megatron's ``MambaMixer.forward``. With a static ``inference_context`` in eval mode
        the conv/SSM states live in ``inference_context.key_value_memory_dict[layer_number]``:
        a prompt (any length) continues from them and one token at a later offset is a
        ``step``."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if packed_seq_params is not None:
            raise ValueError(
                "SubqMambaMixer: packed sequences (packed_seq_params, the trainer's "
                "--reset-attention-mask) are not supported in Mamba layers yet; drop "
                "--reset-attention-mask")
        if inference_context is not None and not self.training:
            if self.cp is not None:
                raise ValueError("SubqMambaMixer: inference with context_parallel_size="
                                 f"{self.cp.cp_size} is not supported: allowed 1")
            return self._inference_forward(hidden_states, inference_context)
        zxBCdt, _ = self.in_proj(hidden_states)
        if self.cp is not None:
            return self.out_proj(self._mix_cp(zxBCdt))
        y = self._mix(zxBCdt)
        return self.out_proj(y)

    def _split_zxbcdt(self, zxBCdt: torch.Tensor, d_inner=None, ngroups=None, nheads=None):
        d_inner = d_inner or self.d_inner_local_tp
        ngroups = ngroups or self.ngroups_local_tp
        nheads = nheads or self.nheads_local_tp
        return torch.split(zxBCdt, [d_inner, d_inner + 2 * ngroups * self.d_state, nheads],
                           dim=-1)

    def _split_xbc(self, xBC: torch.Tensor, d_inner=None, ngroups=None, nheads=None):
        d_inner = d_inner or self.d_inner_local_tp
        ngroups = ngroups or self.ngroups_local_tp
        nheads = nheads or self.nheads_local_tp
        gn = ngroups * self.d_state
        x, B, C = torch.split(xBC, [d_inner, gn, gn], dim=-1)
        lead = x.shape[:-1]
        return (x.reshape(*lead, nheads, self.headdim),
                B.reshape(*lead, ngroups, self.d_state),
                C.reshape(*lead, ngroups, self.d_state))

    def _ssm_params(self, A_log=None, D=None):
        A_log = self.A_log if A_log is None else A_log
        D = self.D if D is None else D
        A = -torch.exp(A_log.float())
        D = D.reshape(-1, self.headdim) if self.D_has_hdim else D
        return A, D

    def _mix_cp(self, zxBCdt: torch.Tensor) -> torch.Tensor:
        """``_mix`` under context parallelism: in_proj's output for this rank's zig-zag
        sequence share [s/cp, b, d_in_proj_local] -> the norm's output [s/cp, b, d_inner_local]
        (the scan over this rank's heads of the whole sequence; see the module docstring)."""
        cp = self.cp
        sizes = dict(d_inner=cp.d_inner_local_tpcp, ngroups=cp.ngroups_local_tpcp,
                     nheads=cp.nheads_local_tpcp)
        z_local = zxBCdt[..., :self.d_inner_local_tp]           # the gate stays sequence-sharded
        heads = cp.pre_conv_ssm(zxBCdt).transpose(0, 1)           # [b, s, d_local_tpcp]
        _, xBC, dt = self._split_zxbcdt(heads, **sizes)
        bias = cp.get_conv1d_bias() if self.conv1d.bias is not None else None
        xBC, _ = causal_conv1d(xBC, cp.get_conv1d_weight()[:, 0, :], bias,
                               activation=self.activation)
        x, B, C = self._split_xbc(xBC, **sizes)
        A, D = self._ssm_params(cp.get_A_log(), cp.get_D())
        y, _ = ssd_chunk(x, dt, A, B, C, D, cp.get_dt_bias(), chunk_size=self.chunk_size)
        y = y.reshape(*y.shape[:2], cp.d_inner_local_tpcp).transpose(0, 1)
        y = cp.post_conv_ssm(y.contiguous())                     # [s/cp, b, d_inner_local]
        return self._gate_and_norm(y, z_local).contiguous()

    def _gate_and_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.rmsnorm:
            return self.norm(y, z)
        return (y.float() * F.silu(z.float())).to(y.dtype)

    def _mix(self, zxBCdt: torch.Tensor, conv_state: Optional[torch.Tensor] = None,
             ssm_state: Optional[torch.Tensor] = None) -> torch.Tensor:
        """in_proj's output [s, b, d_in_proj_local] -> the norm's output [s, b, d_inner_local];
        with states, the sequence continues from them and they are updated in place."""
        z, xBC, dt = self._split_zxbcdt(zxBCdt.transpose(0, 1))          # batch first
        xBC, conv_final = causal_conv1d(xBC, self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                        initial_state=conv_state, activation=self.activation)
        x, B, C = self._split_xbc(xBC)
        A, D = self._ssm_params()
        y, ssm_final = ssd_chunk(x, dt, A, B, C, D, self.dt_bias, chunk_size=self.chunk_size,
                                 initial_state=ssm_state)
        if conv_state is not None:
            conv_state.copy_(conv_final)
        if ssm_state is not None:
            ssm_state.copy_(ssm_final)
        y = y.reshape(*y.shape[:2], self.d_inner_local_tp).transpose(0, 1)
        return self._gate_and_norm(y, z.transpose(0, 1)).contiguous()

    # ---------------------------------------------------------------------------- decoding
    def mamba_state_shapes_per_request(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(conv state shape, SSM state shape) of one sequence, as megatron's mixer."""
        return ((self.conv1d.weight.shape[0], self.d_conv),
                (self.nheads_local_tp, self.headdim, self.d_state))

    def allocate_inference_cache(self, batch_size: int, dtype: Optional[torch.dtype] = None
                                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zero decode states of this rank: conv state [b, conv channels, d_conv] in ``dtype``
        (default: conv1d's), SSM state [b, local heads, head dim, state dim] in float32 (float64
        for float64 parameters), the precision the recurrence accumulates in."""
        conv_shape, ssm_shape = self.mamba_state_shapes_per_request()
        device = self.conv1d.weight.device
        conv_state = torch.zeros(batch_size, *conv_shape, device=device,
                                 dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = torch.zeros(batch_size, *ssm_shape, device=device,
                                dtype=torch.promote_types(self.config.params_dtype, torch.float32))
        return conv_state, ssm_state

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
             ssm_state: torch.Tensor):
        """One decode token: hidden_states [1, b, d_model] -> (out, out_bias); ``conv_state``
        and ``ssm_state`` (from ``allocate_inference_cache``) are updated in place."""
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"SubqMambaMixer.step: hidden_states has shape "
                             f"{tuple(hidden_states.shape)}; expected [1, b, {self.d_model}]")
        if self.config.sequence_parallel:
            raise ValueError("SubqMambaMixer.step: sequence_parallel=True is invalid for "
                             "decoding: allowed False (one token cannot be split)")
        zxBCdt, _ = self.in_proj(hidden_states)
        z, xBC, dt = self._split_zxbcdt(zxBCdt[0])                       # [b, ...]
        xBC, new_conv = causal_conv1d_step(xBC, conv_state, self.conv1d.weight[:, 0, :],
                                           self.conv1d.bias, activation=self.activation)
        x, B, C = self._split_xbc(xBC)
        A, D = self._ssm_params()
        y, new_ssm = ssd_step(ssm_state, x, dt, A, B, C, D, self.dt_bias)
        conv_state.copy_(new_conv)
        ssm_state.copy_(new_ssm)
        y = self._gate_and_norm(y.reshape(1, y.shape[0], self.d_inner_local_tp), z[None])
        return self.out_proj(y)

    def _inference_forward(self, hidden_states, context):
        if context.is_dynamic_batching():
            raise ValueError("SubqMambaMixer: dynamic-batching inference (DynamicInferenceContext)"
                             " is not supported: allowed a static inference context, or "
                             "megatron's MambaMixer (mamba_ssm on CUDA)")
        if self.config.sequence_parallel:
            raise ValueError("SubqMambaMixer: sequence_parallel=True is invalid for inference: "
                             "allowed False")
        if self.layer_number is None:
            raise ValueError("SubqMambaMixer: layer_number=None is invalid for inference: the "
                             "states are kept per layer number")
        conv_state, ssm_state = self._states_from_context(context, hidden_states.shape[1])
        if hidden_states.shape[0] == 1 and context.sequence_len_offset > 0:
            return self.step(hidden_states, conv_state, ssm_state)
        zxBCdt, _ = self.in_proj(hidden_states)
        return self.out_proj(self._mix(zxBCdt, conv_state, ssm_state))

    def _states_from_context(self, context, batch_size: int):
        """This layer's states in a static context: new zeros for a new layer or batch size,
        zeroed at offset 0 (a new prompt), else the cached ones (megatron's rule)."""
        memory = context.key_value_memory_dict
        if self.layer_number not in memory or batch_size != self.cached_batch_size:
            memory[self.layer_number] = self.allocate_inference_cache(batch_size)
            self.cached_batch_size = batch_size
        conv_state, ssm_state = memory[self.layer_number]
        if context.sequence_len_offset == 0:
            conv_state.zero_()
            ssm_state.zero_()
        return conv_state, ssm_state

    # ---------------------------------------------------------------------------- checkpoints
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's ``MambaMixer`` layout: A_log, dt_bias, D, conv1d and norm TP-sharded along
        dim 0, in_proj/out_proj as their linears declare them, then in_proj split into
        ``in_proj.weight.{z,x,B,C,dt}`` and conv1d into ``conv1d.{weight,bias}.{x,B,C}``, so a
        torch_dist checkpoint reshards between TP sizes and shares megatron's keys."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_cp = metadata["dp_cp_group"]
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0, "D": 0},
                                                  sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=dp_cp)
        for name, module in self.named_children():
            if name in ("conv1d", "norm"):
                state = module.state_dict(prefix="", keep_vars=True)
                out.update(make_sharded_tensors_for_checkpoint(
                    state, f"{prefix}{name}.", {k: 0 for k in state}, sharded_offsets,
                    tp_group=self.tp_group, dp_cp_group=dp_cp))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets,
                                                      metadata, tp_group=self.tp_group))
        gn = self.ngroups_local_tp * self.d_state
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            out[f"{prefix}in_proj.weight"],
            [self.d_inner_local_tp, self.d_inner_local_tp, gn, gn, self.nheads_local_tp],
            ["z", "x", "B", "C", "dt"], 0)
        for key in ("conv1d.weight", "conv1d.bias"):
            if f"{prefix}{key}" in out:
                out[f"{prefix}{key}"] = _split_tensor_factory(
                    out[f"{prefix}{key}"], [self.d_inner_local_tp, gn, gn], ["x", "B", "C"], 0)
        return out
