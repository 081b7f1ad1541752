"""The host tiling shared by the Ascend training and inference attention ops gives every token the
same tile plan (KV split, tile order, row tile, GEMM shape class) in every view: training forward,
prefill alone, chunked prefill over a packed prefix or a paged cache, and paged decode in mixed
batches — for lengths that cross tile boundaries, GQA ratios 1/2/4, several row tiles, block
sizes, page sizes and worker counts. Also the matmul and row-operator plans do not depend on M.

The plans come from kernels/ascendc/common/tile_plan.cpp compiled here with g++ (the same source
the CANN op_host tiling compiles), called through its C ABI.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from ascend_cpu_support import Geometry, KvTask, NativeLib, Plan, Task, TokenPlan


@dataclass(frozen=True)
class Case:
    kv_tile: int
    group: int
    row_tile: int = 8
    row_tiles_per_block: int = 1
    page_mult: int = 1
    head_dim: int = 16
    num_kv_heads: int = 2

    @property
    def lens(self) -> list[int]:
        t = self.kv_tile
        return [1, t - 1, t, t + 1, 2 * t + 3, 3]

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group


CASES = [
    Case(16, 1), Case(16, 2), Case(16, 4), Case(64, 1), Case(64, 2), Case(64, 4),
    Case(16, 2, row_tile=16), Case(16, 4, row_tiles_per_block=4), Case(64, 2, row_tiles_per_block=2),
    Case(16, 2, page_mult=2), Case(64, 4, page_mult=2, row_tile=16), Case(32, 8, num_kv_heads=1, head_dim=32),
]


def consts(native: NativeLib, c: Case):
    return native.consts(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                         kv_tile=c.kv_tile, row_tile=c.row_tile, row_tiles_per_block=c.row_tiles_per_block)


def block_table(lens: list[int], page: int, seed: int = 0) -> np.ndarray:
    """Shuffled page assignment; unused entries point at a spare page."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages_per) + 1, generator=gen).tolist()
    table = np.full((len(lens), max(pages_per) + 1), perm[-1], dtype=np.int32)
    used = 0
    for s, n in enumerate(pages_per):
        table[s, :n] = perm[used:used + n]
        used += n
    return table


def canonical(tok: TokenPlan, logical) -> tuple:
    """The arithmetic-relevant part of a token's plan, with physical K/V rows made logical."""
    eff = tok.tiles_effective
    tiles = tuple((logical(row), cols) for row, cols in zip(tok.tile_kv_rows[:eff], tok.tile_cols[:eff], strict=True))
    noop_after = all(c == 0 for c in tok.tile_cols[eff:])
    return (tok.block_rows, tok.kv_tile, tok.head_dim, tok.kv_split, tok.position, eff, tiles, noop_after)


def expected(c: Case, pos: int) -> tuple:
    """The contract from first principles: tiles 0..pos//kv_tile ascending, all kv_tile wide."""
    t = c.kv_tile
    tiles = tuple((j * t, min(t, pos - j * t + 1)) for j in range(pos // t + 1))
    return (c.row_tile * c.row_tiles_per_block, t, c.head_dim, 1, pos, pos // t + 1, tiles, True)


def contiguous_logical(offset: int):
    return lambda row: row - offset


def paged_logical(table: np.ndarray, seq: int, page: int):
    index = {int(p): i for i, p in enumerate(table[seq])}  # first occurrence wins; spares come last
    return lambda row: index[row // page] * page + row % page


def views(native: NativeLib, c: Case):
    """Yield (name, plan, [(seq_in_view, query_in_view, seq, position)], logical(seq_in_view)) per view."""
    lens = c.lens
    cst = consts(native, c)
    cu = np.concatenate([[0], np.cumsum(lens)])
    page = c.kv_tile * c.page_mult
    table = block_table(lens, page)

    # prefill of each sequence alone (contiguous, training op)
    for s, n in enumerate(lens):
        yield (f"prefill-alone[{s}]", native.plan_training(cst, [n]),
               [(0, i, s, i) for i in range(n)], lambda _v: contiguous_logical(0))
    # chunked prefill over a packed prefix (contiguous, q_start > 0)
    for chunk in (1, c.kv_tile - 1, c.kv_tile + 5):
        starts = [min(n - 1, chunk) for n in lens]
        plan = native.plan_contiguous(cst, [n - st for n, st in zip(lens, starts, strict=True)], starts, lens,
                                      cu[:-1].tolist())
        toks = [(s, i - st, s, i) for s, (n, st) in enumerate(zip(lens, starts, strict=True)) for i in range(st, n)]
        yield f"chunked-contiguous[{chunk}]", plan, toks, lambda v: contiguous_logical(int(cu[v]))
    # chunked prefill over the paged cache, all sequences in one call
    for chunk in (1, 3, c.kv_tile + 5):
        starts = [min(n - 1, chunk) for n in lens]
        plan = native.plan_paged(cst, [n - st for n, st in zip(lens, starts, strict=True)], starts, lens, table, page)
        toks = [(s, i - st, s, i) for s, (n, st) in enumerate(zip(lens, starts, strict=True)) for i in range(st, n)]
        yield f"chunked-paged[{chunk}]", plan, toks, lambda v: paged_logical(table, v, page)
    # paged decode: step t decodes position t of every sequence that long, in one mixed batch
    for t in range(max(lens)):
        seqs = [s for s, n in enumerate(lens) if n > t]
        plan = native.plan_paged(cst, [1] * len(seqs), [t] * len(seqs), [t + 1] * len(seqs), table[seqs], page,
                                 workers=7)
        yield (f"decode[{t}]", plan, [(v, 0, s, t) for v, s in enumerate(seqs)],
               lambda v, seqs=seqs: paged_logical(table, seqs[v], page))
    # one mixed batch: the longest sequence prefills its tail while the others decode their last token
    longest = int(np.argmax(lens))
    q_lens = [lens[s] - (lens[s] // 2 if s == longest else lens[s] - 1) for s in range(len(lens))]
    starts = [lens[s] - q_lens[s] for s in range(len(lens))]
    plan = native.plan_paged(cst, q_lens, starts, lens, table, page, workers=3)
    toks = [(s, i - starts[s], s, i) for s in range(len(lens)) for i in range(starts[s], lens[s])]
    yield "mixed-prefill-decode", plan, toks, lambda v: paged_logical(table, v, page)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"kv{c.kv_tile}-g{c.group}-r{c.row_tile}x{c.row_tiles_per_block}"
                         f"-p{c.page_mult}-d{c.head_dim}")
def test_training_and_inference_views_get_the_same_tile_plan(native: NativeLib, case: Case) -> None:
    lens = case.lens
    train = native.plan_training(consts(native, case), lens)
    cu = np.concatenate([[0], np.cumsum(lens)])
    train_plan = {}
    for s, n in enumerate(lens):
        for i in range(n):
            for h in range(case.num_heads):
                tok = train.token(s, i, h)
                train_plan[s, i, h] = canonical(tok, contiguous_logical(int(cu[s])))
                assert train_plan[s, i, h] == expected(case, i), (s, i, h)
    checked = 0
    for name, plan, toks, logical_of in views(native, case):
        for v_seq, v_query, seq, pos in toks:
            for h in range(case.num_heads):
                got = canonical(plan.token(v_seq, v_query, h), logical_of(v_seq))
                assert got == train_plan[seq, pos, h], f"{name}: seq {seq} pos {pos} head {h}"
                checked += 1
    assert checked > 4 * sum(lens)


@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: f"kv{c.kv_tile}-g{c.group}")
def test_every_row_is_owned_by_exactly_one_task(native: NativeLib, case: Case) -> None:
    plan = native.plan_training(consts(native, case), case.lens)
    g: Geometry = plan.geometry
    seen: dict[tuple[int, int, int], int] = {}
    tasks: list[Task] = plan.tasks()
    assert len(tasks) == g.num_tasks
    for t, task in enumerate(tasks):
        assert 0 < task.valid_rows <= g.block_rows
        assert task.num_kv_tiles == task.last_pos // g.kv_tile + 1  # never a tile past the block's last row
        for r in range(task.valid_rows):
            key = (task.seq, task.kv_head, task.first_row + r)
            assert key not in seen
            seen[key] = t
    expect = {(s, h, r) for s, n in enumerate(case.lens) for h in range(g.num_kv_heads) for r in range(n * g.group)}
    assert set(seen) == expect


@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: f"kv{c.kv_tile}-g{c.group}")
def test_backward_kv_tasks_accumulate_every_contributing_block_in_order(native: NativeLib, case: Case) -> None:
    plan = native.plan_training(consts(native, case), case.lens)
    g = plan.geometry
    tasks = plan.tasks()
    kv_tasks: list[KvTask] = plan.kv_tasks()
    assert len(kv_tasks) == g.num_kv_tasks
    covered = set()
    for kt in kv_tasks:
        key = (kt.seq, kt.kv_head, kt.tile)
        assert key not in covered
        covered.add(key)
        blocks = [t for t in tasks if t.seq == kt.seq and t.kv_head == kt.kv_head]
        seeing = [t.block for t in blocks if t.last_pos >= kt.tile * g.kv_tile]
        assert seeing == list(range(kt.first_block, kt.first_block + kt.num_blocks))
        assert kt.valid_kv == min(g.kv_tile, case.lens[kt.seq] - kt.tile * g.kv_tile)
    assert covered == {(s, h, j) for s, n in enumerate(case.lens) for h in range(g.num_kv_heads)
                       for j in range(-(-n // g.kv_tile))}


def test_worker_count_changes_only_the_dealing(native: NativeLib) -> None:
    case = Case(16, 2)
    cst = consts(native, case)
    fields = [f for f, _ in Task._fields_]
    ref = [tuple(getattr(t, f) for f in fields) for t in native.plan_training(cst, case.lens, workers=1).tasks()]
    for workers in (2, 7, 24, 48, 1000):
        plan: Plan = native.plan_training(cst, case.lens, workers=workers)
        assert [tuple(getattr(t, f) for f in fields) for t in plan.tasks()] == ref
        assert plan.geometry.workers == min(workers, max(plan.geometry.num_tasks, plan.geometry.num_kv_tasks))


def test_cursor_walk_and_fresh_decoding_agree(native: NativeLib) -> None:
    """Workers decode with a monotone cursor; a task decoded from scratch must be the same."""
    case = Case(16, 4, row_tiles_per_block=2)
    plan = native.plan_training(consts(native, case), case.lens)
    fields, kv_fields = [f for f, _ in Task._fields_], [f for f, _ in KvTask._fields_]
    for i, walked in enumerate(plan.tasks()):
        fresh = Task()
        assert native.dll.op_tp_decode_task(plan.handle, i, ctypes.byref(fresh)) == 0
        assert [getattr(fresh, f) for f in fields] == [getattr(walked, f) for f in fields]
    for i, walked in enumerate(plan.kv_tasks()):
        fresh = KvTask()
        assert native.dll.op_tp_decode_kv_task(plan.handle, i, ctypes.byref(fresh)) == 0
        assert [getattr(fresh, f) for f in kv_fields] == [getattr(walked, f) for f in kv_fields]
    assert native.dll.op_tp_decode_task(plan.handle, len(plan.tasks()), ctypes.byref(Task())) == -1


def test_invalid_geometry_is_rejected_with_a_message(native: NativeLib) -> None:
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        native.plan_training(native.consts(num_heads=3, num_kv_heads=2, head_dim=16, kv_tile=16), [4])
    with pytest.raises(RuntimeError, match="kv_tile"):
        native.plan_training(native.consts(num_heads=2, num_kv_heads=2, head_dim=16, kv_tile=24), [4])
    with pytest.raises(RuntimeError, match="page_size"):
        native.plan_paged(native.consts(num_heads=2, num_kv_heads=2, head_dim=16, kv_tile=16), [1], [0], [1],
                          np.zeros((1, 1), np.int32), 8)
    with pytest.raises(RuntimeError, match="UB"):
        native.plan_training(native.consts(num_heads=2, num_kv_heads=2, head_dim=256, kv_tile=512, row_tile=128), [4])


def test_abi_struct_layouts_match(native: NativeLib) -> None:
    assert native.dll.op_tp_sizeof_geometry() == ctypes.sizeof(Geometry)
    assert native.dll.op_tp_sizeof_task() == ctypes.sizeof(Task)
    assert native.dll.op_tp_sizeof_kv_task() == ctypes.sizeof(KvTask)


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_matmul_plan_is_one_tiling_for_every_m(native: NativeLib, dtype_bytes: int) -> None:
    n, k = 1000, 4095
    ref = native.matmul_plan(1, n, k, dtype_bytes)
    assert ref.split_k == 1
    for m in [*range(1, 40), 127, 128, 129, 255, 1000, 4097]:
        p = native.matmul_plan(m, n, k, dtype_bytes)
        # the reduction of every output element: same base_k, same number of K steps, one worker
        assert (p.base_m, p.base_n, p.base_k, p.k_steps, p.split_k, p.n_tiles) == (
            ref.base_m, ref.base_n, ref.base_k, ref.k_steps, 1, ref.n_tiles)
        assert p.m_tiles == -(-m // p.base_m)


def test_row_plans_do_not_depend_on_the_row_count(native: NativeLib) -> None:
    ref = native.row_plan(1, 151936, 4)
    for rows in (2, 7, 64, 1000):
        p = native.row_plan(rows, 151936, 4)
        assert (p.cols, p.chunk, p.chunks) == (ref.cols, ref.chunk, ref.chunks)
