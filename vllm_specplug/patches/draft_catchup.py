"""The zero-cost fallback's draft-KV repair: stale blocks and catch-up passes.

Part of the ``draft_model_skip`` patch (``patches/draft_model_skip.py``, whose
header says why it exists, what it changes, which vLLM it was checked against
and when it can go; it wraps vLLM's proposer and calls what is here).  This
module wraps nothing of vLLM's: it keeps the worker's counters
(``DraftSkipStats``), which physical KV blocks the draft model did not write
(``_StaleBlocks``), and plans and runs the draft passes that repair them
(``_catch_up_passes``, ``_catch_up``), with the vLLM names that
``draft_model_skip._check`` probes for at install.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

@dataclass
class DraftSkipStats:
    """Counters a test or a log line can read (worker process)."""

    skipped_passes: int = 0
    draft_passes: int = 0
    catch_up_passes: int = 0
    catch_up_tokens: int = 0
    # The patch's own code raised: the fallback is off for this proposer.
    failures: int = 0


class _StaleBlocks:
    """Physical KV blocks whose draft-model KV was not written."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stale = np.zeros(1024, dtype=bool)
        self.count = 0

    def _grow(self, max_id: int) -> None:
        if max_id >= self.stale.size:
            size = self.stale.size
            while size <= max_id:
                size *= 2
            grown = np.zeros(size, dtype=bool)
            grown[: self.stale.size] = self.stale
            self.stale = grown

    def mark(self, table: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Mark the blocks holding positions [start, end] of each row."""
        bs = self.block_size
        width = table.shape[1]
        for r in range(starts.size):
            b0 = int(starts[r]) // bs
            b1 = min(int(ends[r]) // bs + 1, width)
            if b1 <= b0:
                continue
            ids = table[r, b0:b1]
            ids = ids[ids > 0]  # 0 is vLLM's null block (table padding), never real KV
            if ids.size == 0:
                continue
            self._grow(int(ids.max()))
            self.stale[ids] = True
        self.count = int(np.count_nonzero(self.stale))

    def first_stale(self, table_row: np.ndarray, end: int) -> int | None:
        """First position of the first stale block among positions < end."""
        if self.count == 0 or end <= 0:
            return None
        nb = min((end + self.block_size - 1) // self.block_size, table_row.size)
        ids = table_row[:nb]
        ids = ids[ids < self.stale.size]
        hit = self.stale[ids]
        if not hit.any():
            return None
        return int(np.argmax(hit)) * self.block_size

    def clear(self, table: np.ndarray, ends: np.ndarray) -> None:
        """Unmark every block of each row up to position ``end`` (written now)."""
        if self.count == 0:
            return
        bs = self.block_size
        width = table.shape[1]
        for r in range(ends.size):
            nb = min(int(ends[r]) // bs + 1, width)
            ids = table[r, :nb]
            ids = ids[ids < self.stale.size]
            self.stale[ids] = False
        self.count = int(np.count_nonzero(self.stale))


def _rows_view(cad):
    """Per row: computed length at step start (c), seq_len (s), block table."""
    qsl = cad.query_start_loc_cpu.numpy().astype(np.int64)
    seq = cad.seq_lens
    seq = (seq if seq.device.type == "cpu" else seq.cpu()).numpy().astype(np.int64)
    num_reqs = int(cad.num_reqs)
    qlen = qsl[1: num_reqs + 1] - qsl[:num_reqs]
    seq = seq[:num_reqs]
    table = cad.block_table_tensor
    table = (table if table.device.type == "cpu" else table.cpu()).numpy()[:num_reqs]
    return seq - qlen, seq, table


def _catch_up_passes(proposer, stale: _StaleBlocks, cad, starts: np.ndarray,
                     table: np.ndarray) -> list[tuple]:
    """The draft passes that repair every row's stale context, as prefill chunks.

    Only prepares them (inputs, attention metadata): nothing here talks to
    another rank, so a failure can still be agreed on before any pass runs.
    """
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    pieces = []  # (row, start, end)
    for r in range(starts.size):
        first = stale.first_stale(table[r], int(starts[r]))
        if first is not None:
            pieces.append((r, first, int(starts[r])))
    if not pieces:
        return []
    token_ids = proposer.__dict__["_specplug_runner"].input_batch.token_ids_cpu
    budget = int(proposer.max_num_tokens)
    bs = stale.block_size
    device = cad.block_table_tensor.device
    # Split into forward passes of at most `budget` tokens; a long gap is
    # split into consecutive chunks of one row (each attends to the KV the
    # previous chunk wrote, exactly like chunked prefill).
    batches, cur, used = [], [], 0
    for r, a, b in pieces:
        while a < b:
            take = min(b - a, budget - used)
            cur.append((r, a, a + take))
            used += take
            a += take
            if used >= budget:
                batches.append(cur)
                cur, used = [], 0
    if cur:
        batches.append(cur)
    passes = []
    for chunk in batches:
        rows = np.array([p[0] for p in chunk], dtype=np.int64)
        lens = np.array([p[2] - p[1] for p in chunk], dtype=np.int64)
        ends = np.array([p[2] for p in chunk], dtype=np.int64)
        positions = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in chunk])
        row_of_token = np.repeat(rows, lens)
        ids = token_ids[row_of_token, positions]
        slots = table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.zeros(rows.size + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        n = int(qsl[-1])
        qsl_cpu = torch.from_numpy(qsl)
        seq_cpu = torch.from_numpy(ends.astype(np.int32))
        cu = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(device),
            num_reqs=int(rows.size),
            num_actual_tokens=n,
            max_query_len=int(lens.max()),
            max_seq_len=int(ends.max()),
            block_table_tensor=cad.block_table_tensor[torch.from_numpy(rows).to(device)],
            slot_mapping=torch.from_numpy(slots).to(device),
            causal=True,
            positions=torch.from_numpy(positions).to(device),
            seq_lens_cpu_upper_bound=seq_cpu,
        )
        _, per_layer = proposer.build_per_group_and_layer_attn_metadata(cu)
        input_ids = torch.from_numpy(np.ascontiguousarray(ids)).to(
            device=device, dtype=proposer.input_ids.dtype)
        pos_t = torch.from_numpy(positions).to(device)
        passes.append((per_layer, input_ids, pos_t, n,
                       proposer._get_slot_mapping(n, cu.slot_mapping)))
    return passes


def _catch_up(proposer, passes: list[tuple], stats: DraftSkipStats) -> None:
    """Run the prepared catch-up passes of the draft model."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    for per_layer, input_ids, pos_t, n, slot_mapping in passes:
        with set_forward_context(per_layer, proposer.vllm_config, num_tokens=n,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=slot_mapping):
            proposer.model(input_ids=input_ids, positions=pos_t, inputs_embeds=None)
        stats.catch_up_passes += 1
        stats.catch_up_tokens += n
