"""The emulation of torch_npu's MoE routing ops (sources and numerics: `vendors.ascend.emulation.torch_npu_ops`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vendors.ascend.emulation.common import err, tensor_arg, check_dtype, check_shape, quantize_rows, FLOAT, INT8_MAX


class RoutingOps:
    """`npu_moe_init_routing_v2` and `npu_moe_finalize_routing`, emulated (a mixin of `EmulatedTorchNpu`)."""

    # ------------------------------------------------------------------ MoE routing
    def npu_moe_init_routing_v2(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
        active_num: int = -1,
        expert_capacity: int = -1,
        expert_num: int = -1,
        drop_pad_mode: int = 0,
        expert_tokens_num_type: int = 0,
        expert_tokens_num_flag: bool = False,
        quant_mode: int = -1,
        active_expert_range: Sequence[int] | None = None,
        row_idx_type: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """MoE routing: gather each token once per chosen expert, sorted by expert.

        The NUM_ROWS*K (token, expert) pairs whose expert lies in active_expert_range
        [start, end) are sorted by expert id (stable); the d-th of them becomes row d of
        expanded_x (a copy of its token's row). expanded_row_idx (int32 [NUM_ROWS*K]) maps
        pair -> d (row_idx_type 0, gather form, -1 for inactive pairs) or d -> pair
        (row_idx_type 1, scatter form). The third output counts rows per expert: int64
        [end-start] (expert_tokens_num_type 1), or int64 [expert_num, 2] (expert, count)
        pairs for experts with a non-zero count, in id order, followed by a (0, 0) end
        marker (type 2). expanded_scale (float32) is scale[token] per row for
        quant_mode -1, or the per-row scale of a dynamic int8 quantization of the
        (optionally smoothed by scale[expert - start]) rows for quant_mode 1, with
        npu_dynamic_quant's formula.
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration.
        assumption: pairs are numbered p = i*K + k (expert_idx's row-major order) and
        ties keep that order. assumption: rows past the valid ones (the docs leave them
        undefined) are zeros in expanded_x and expanded_scale, -1 in the scatter index.
        assumption: active_num > 0 keeps only the first active_num sorted pairs
        (expanded_x then has min(active_num, NUM_ROWS*K) rows, as in the meta function);
        dropped pairs get -1 and are not counted. assumption: a scale of shape [1, H]
        in quant_mode 1 (accepted by the meta function) smooths every expert alike.
        """
        op = "npu_moe_init_routing_v2"
        x = tensor_arg(op, "x", x)
        expert_idx = tensor_arg(op, "expert_idx", expert_idx)
        check_dtype(op, "x", x, (*FLOAT, torch.int8))
        check_dtype(op, "expert_idx", expert_idx, (torch.int32,))
        if x.dim() != 2 or expert_idx.dim() != 2 or x.shape[0] != expert_idx.shape[0]:
            raise err(
                op,
                f"x [NUM_ROWS, H] and expert_idx [NUM_ROWS, K] must be 2-D with equal rows, "
                f"got {list(x.shape)} and {list(expert_idx.shape)}",
            )
        self._check_routing_version(op, expert_idx.numel(), active_num, active_expert_range)
        start, end = self._routing_options(
            op,
            x,
            offset,
            active_num,
            expert_num,
            drop_pad_mode,
            expert_tokens_num_type,
            expert_tokens_num_flag,
            quant_mode,
            active_expert_range,
            row_idx_type,
        )
        self._check_routing_scale(op, x, scale, quant_mode, end - start)
        ids = expert_idx.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= expert_num):
            raise err(
                op, f"expert ids must be in [0, {expert_num}), got values in [{int(ids.min())}, {int(ids.max())}]"
            )
        pairs = ids.numel()
        rows_out = pairs if active_num <= 0 else min(active_num, pairs)
        active = ((ids >= start) & (ids < end)).nonzero().squeeze(1)
        order = torch.sort(ids[active], stable=True).indices
        kept = active[order][:rows_out]  # pair index of each valid expanded row
        n_kept = kept.numel()
        top_k = expert_idx.shape[1]
        tokens = torch.div(kept, top_k, rounding_mode="floor")
        experts = ids[kept]

        row_idx = torch.full((pairs,), -1, dtype=torch.int32, device=x.device)
        if row_idx_type == 0:
            row_idx[kept] = torch.arange(n_kept, dtype=torch.int32, device=x.device)
        else:
            row_idx[:n_kept] = kept.to(torch.int32)
        counts = torch.bincount(experts - start, minlength=end - start).to(torch.int64)
        if expert_tokens_num_type == 2:
            key_values = torch.zeros((expert_num, 2), dtype=torch.int64, device=x.device)
            present = counts.nonzero().squeeze(1)
            key_values[: present.numel(), 0] = present + start
            key_values[: present.numel(), 1] = counts[present]
            counts = key_values  # the rows after the valid pairs are zero: the (0, 0) marker

        expanded_scale = torch.zeros(rows_out, dtype=torch.float32, device=x.device)
        if quant_mode == 1:
            rows = x.to(torch.float32)[tokens]
            if scale is not None:
                smooth = scale.to(torch.float32)
                rows = rows * (smooth[experts - start] if smooth.shape[0] == end - start else smooth[0])
            expanded_x = torch.zeros((rows_out, x.shape[1]), dtype=torch.int8, device=x.device)
            expanded_x[:n_kept], expanded_scale[:n_kept] = quantize_rows(rows, INT8_MAX, torch.int8)
        else:
            expanded_x = x.new_zeros((rows_out, x.shape[1]))
            expanded_x[:n_kept] = x[tokens]
            if scale is not None:
                expanded_scale[:n_kept] = scale.to(torch.float32)[tokens]
        return expanded_x, row_idx, counts, expanded_scale

    def _routing_options(
        self,
        op: str,
        x: torch.Tensor,
        offset: object,
        active_num: int,
        expert_num: int,
        drop_pad_mode: int,
        num_type: int,
        num_flag: bool,
        quant_mode: int,
        active_expert_range: Sequence[int] | None,
        row_idx_type: int,
    ) -> tuple[int, int]:
        """Validate the integer options; returns the active expert range [start, end)."""
        limit = 5120 if num_type == 2 else 10240
        rules = (
            (offset is None, "offset must be None (neither supported mode uses it), got a tensor"),
            (drop_pad_mode == 0, f"drop_pad_mode: only 0 (dropless) is supported, got {drop_pad_mode}"),
            (
                num_type in (1, 2),
                f"expert_tokens_num_type: only 1 and 2 are supported (count, key_value), got {num_type}",
            ),
            (num_flag is True, f"expert_tokens_num_flag: only True is supported, got {num_flag}"),
            (quant_mode in (-1, 1), f"quant_mode: only -1 (none) and 1 (dynamic int8) are supported, got {quant_mode}"),
            (
                quant_mode != 1 or x.dtype != torch.int8,
                "quant_mode must be -1 when x is int8 (no requantization), got 1",
            ),
            (row_idx_type in (0, 1), f"row_idx_type must be 0 (gather) or 1 (scatter), got {row_idx_type}"),
            (active_num >= -1, f"active_num must be >= -1, got {active_num}"),
            (
                0 < expert_num <= limit,
                f"expert_num must be in (0, {limit}] for expert_tokens_num_type {num_type}, got {expert_num}",
            ),
        )
        for ok, message in rules:
            if not ok:
                raise err(op, message)
        if active_expert_range is None or len(active_expert_range) == 0:
            return 0, expert_num
        bounds = list(active_expert_range)
        if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1] <= expert_num:
            raise err(
                op,
                f"active_expert_range must be [start, end) with 0 <= start < end <= expert_num "
                f"({expert_num}), got {bounds}",
            )
        return int(bounds[0]), int(bounds[1])

    def _check_routing_version(
        self, op: str, pairs: int, active_num: int, active_expert_range: Sequence[int] | None
    ) -> None:
        """Rules of the older schemas: 2.8's meta function wants active_expert_range as two ints;
        before 2.13 the docs want active_num equal to the pair count (its -1 default is
        documented as valid only from 2.13; the reference notes)."""
        version = getattr(self, "version", "2.13")
        if version == "2.8" and (active_expert_range is None or len(active_expert_range) != 2):
            raise err(op, f"active_expert_range must be int[2] in torch_npu 2.8, got {active_expert_range!r}")
        if version != "2.13" and active_num != pairs:
            raise err(
                op,
                f"active_num must equal NUM_ROWS*K = {pairs} in torch_npu {version} (pass it "
                f"explicitly), got {active_num}",
            )

    @staticmethod
    def _check_routing_scale(
        op: str, x: torch.Tensor, scale: torch.Tensor | None, quant_mode: int, experts: int
    ) -> None:
        if scale is None:
            return
        scale = tensor_arg(op, "scale", scale)
        check_dtype(op, "scale", scale, (torch.float32,))
        if quant_mode == -1 and tuple(scale.shape) != (x.shape[0],):
            raise err(op, f"scale must be [NUM_ROWS] = [{x.shape[0]}] when quant_mode is -1, got {list(scale.shape)}")
        if quant_mode == 1 and (scale.dim() != 2 or scale.shape[0] not in (experts, 1) or scale.shape[1] != x.shape[1]):
            raise err(op, f"scale must be [{experts} or 1, {x.shape[1]}] when quant_mode is 1, got {list(scale.shape)}")

    def npu_moe_finalize_routing(
        self,
        expanded_permuted_rows: torch.Tensor,
        skip1: torch.Tensor | None,
        skip2: torch.Tensor | None,
        bias: torch.Tensor | None,
        scales: torch.Tensor | None,
        expanded_src_to_dst_row: torch.Tensor,
        export_for_source_row: torch.Tensor | None,
        drop_pad_mode: int = 0,
        k: int = 1,
    ) -> torch.Tensor:
        """MoE combine: weighted sum of each token's K expert outputs, plus skips and bias.

        Formula: out[i, j] = skip1[i, j] + skip2[i, j] + sum over k of scales[i, k] *
        (rows[src_to_dst[i + k*NUM_ROWS], j] + bias[export_for_source_row[i, k], j]).
        The index into expanded_src_to_dst_row is k-major (i + k*NUM_ROWS). Missing
        skips and bias contribute nothing; without scales every weight is 1 and K is
        `k`. NUM_ROWS = rows / K. Computed in float32, cast once to the rows' dtype.
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration; `k` only in the
        2.13 schema (the versioned binding rejects it for older versions).
        drop_pad_mode 2 and 3 index row-major (i*K + k); modes 1 and 3 take rows as
        [E, C, H] (the meta function's drop-pad branch). assumption: in modes 1-3 an index
        of -1 is a dropped route and contributes nothing (mode 0 keeps [0, rows)).
        assumption: when scales is given its second dim is K and `k` is not consulted.
        """
        op = "npu_moe_finalize_routing"
        rows = tensor_arg(op, "expanded_permuted_rows", expanded_permuted_rows)
        src = tensor_arg(op, "expanded_src_to_dst_row", expanded_src_to_dst_row)
        if drop_pad_mode not in (0, 1, 2, 3):
            raise err(op, f"drop_pad_mode must be 0, 1, 2 or 3, got {drop_pad_mode}")
        check_dtype(op, "expanded_permuted_rows", rows, FLOAT)
        padded = drop_pad_mode in (1, 3)  # [E, C, H] rows (the meta function's drop-pad branch)
        if rows.dim() != (3 if padded else 2):
            raise err(
                op,
                f"expanded_permuted_rows must be {'3-D [E, C, H]' if padded else '2-D [NUM_ROWS*K, H]'} "
                f"for drop_pad_mode {drop_pad_mode}, got {list(rows.shape)}",
            )
        rows = rows.reshape(-1, rows.shape[-1])
        top_k = scales.shape[1] if isinstance(scales, torch.Tensor) and scales.dim() == 2 else k
        total = rows.shape[0] if drop_pad_mode == 0 else src.numel()
        if top_k <= 0 or total % top_k:
            raise err(op, f"K ({top_k}) must be positive and divide the (token, k) pairs {total}")
        num_rows, hidden = total // top_k, rows.shape[1]
        check_dtype(op, "expanded_src_to_dst_row", src, (torch.int32,))
        check_shape(op, "expanded_src_to_dst_row", src, [num_rows * top_k])
        low = 0 if drop_pad_mode == 0 else -1  # -1: a dropped route (drop_pad_mode 1-3), contributing 0
        if src.numel() and (int(src.min()) < low or int(src.max()) >= rows.shape[0]):
            raise err(
                op,
                f"expanded_src_to_dst_row values must be in [{low}, {rows.shape[0] - 1}] for "
                f"drop_pad_mode {drop_pad_mode}, got values in [{int(src.min())}, {int(src.max())}]",
            )
        for name, t, shape in (
            ("scales", scales, [num_rows, top_k]),
            ("skip1", skip1, [num_rows, hidden]),
            ("skip2", skip2, [num_rows, hidden]),
        ):
            if t is not None:
                check_dtype(op, name, tensor_arg(op, name, t), (rows.dtype,))
                check_shape(op, name, t, shape)
        if skip2 is None and skip1 is not None:
            raise err(op, "skip1 must be None when skip2 is None")
        index = src.to(torch.int64)  # k-major (i + k*NUM_ROWS) for modes 0/1, row-major (i*K + k) for 2/3
        index = index.reshape(num_rows, top_k) if drop_pad_mode in (2, 3) else index.reshape(top_k, num_rows).t()
        gathered = rows.to(torch.float32)[index.clamp(min=0)] * (index >= 0).unsqueeze(-1)  # [NUM_ROWS, K, H]
        if export_for_source_row is not None:
            experts = tensor_arg(op, "export_for_source_row", export_for_source_row)
            check_dtype(op, "export_for_source_row", experts, (torch.int32,))
            check_shape(op, "export_for_source_row", experts, [num_rows, top_k])
        if bias is not None:
            gathered = gathered + self._finalize_bias(op, rows, bias, export_for_source_row)
        weights = torch.ones((num_rows, top_k), device=rows.device) if scales is None else scales.to(torch.float32)
        out = (gathered * weights.unsqueeze(-1)).sum(dim=1)
        for skip in (skip1, skip2):
            if skip is not None:
                out = out + skip.to(torch.float32)
        return out.to(rows.dtype)

    @staticmethod
    def _finalize_bias(op: str, rows: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
        """bias[expert(i, k)] as float32 [NUM_ROWS, K, H]."""
        bias = tensor_arg(op, "bias", bias)
        check_dtype(op, "bias", bias, (rows.dtype,))
        if bias.dim() != 2 or bias.shape[1] != rows.shape[1]:
            raise err(op, f"bias must be [E, {rows.shape[1]}], got {list(bias.shape)}")
        if experts is None:
            raise err(op, "export_for_source_row is required when bias is given, got None")
        ids = experts.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bias.shape[0]):
            raise err(
                op,
                f"export_for_source_row values must be in [0, {bias.shape[0]}), "
                f"got values in [{int(ids.min())}, {int(ids.max())}]",
            )
        return bias.to(torch.float32)[ids]
