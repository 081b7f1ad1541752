"""Native CPU kernels of the consistent operator set, and their build.

- ``rowdot`` (``rowdot.c``): the linear whose order of additions is fixed by the algorithm, so its
  bits do not depend on the row count, the columns a call computes, the micro-tile or the thread
  count; its chunked form, the canonical row-parallel reduction in one call (``chunked_linear``);
  and its group form, the projections of one input in one call (``linears``).
- the attention tile routine (``attention.c``, wrapped by :mod:`.attention`): each query row reads
  its own sequence's K/V rows through an index, so paged decode, prefill and training share it;
  its gradient (``attention_backward.c``) in one call too.
- RMSNorm, RoPE and SwiGLU (``rowwise.c``, wrapped by :mod:`.rowwise`), one call each.
- every dense decoder layer of a forward pass in one call (``stack.c``, wrapped by :mod:`.stack`),
  chaining the kernels above with the per-operator path's bits.
- ``native.h``: what they share (bf16 conversions, the dot product's lanes and lane tree, ``exp_``).

The C sources are compiled together on first use with the system C compiler (``$CC``, default
``cc``) into ``$ONPOLICY_HOME/native/`` under a name that hashes the sources, the flags and the
compiler's version, and loaded with ctypes; ``onpolicy selftest`` and ``scripts/setup.sh`` build it ahead.
The build is atomic (compiled to a temporary name, then renamed), so processes that start together
(Ray actors) never load a half-written library. Its OpenMP runtime is torch's own ``libgomp``
(loaded first, same soname), so it shares torch's thread pool instead of competing with it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from onpolicy.home import onpolicy_home

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("native.h", "rowdot.c", "attention.c", "attention_backward.c", "rowwise.c", "stack.c"))
#: No -ffast-math, no FP contraction: the source's operations are the arithmetic.
CFLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_OPERAND_DTYPES = (torch.float32, torch.bfloat16)


class NativeBuildError(RuntimeError):
    """The C compiler is missing or failed; the message says which and how."""


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def _compiler_version(cc: str) -> str:
    path = shutil.which(cc)
    if path is None:
        raise NativeBuildError(
            f"the consistent kernels need a C compiler to build {SOURCES[1].parent}, and {cc!r} was not found "
            "(install gcc, e.g. `apt-get install gcc`, or point $CC at one)")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else path


@functools.cache
def _build_digest(cc: str) -> str:
    """Hash of the sources, the flags and the compiler's version (one ``cc --version`` per process)."""
    digest = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES), " ".join(CFLAGS).encode(), _compiler_version(cc).encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """Where the library for these sources, these flags and this compiler lives."""
    return onpolicy_home() / "native" / f"onpolicy-native-{_build_digest(compiler())}.so"


def build() -> Path:
    """Compile the C sources unless this exact build exists; returns the library's path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"  # link torch's libgomp (the runtime it loaded)
    fd, tmp = tempfile.mkstemp(prefix=".onpolicy-native-", suffix=".so", dir=target.parent)
    os.close(fd)
    sources = [str(s) for s in SOURCES if s.suffix == ".c"]
    cmd = [compiler(), *CFLAGS, *sources, "-o", tmp, f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            tail = (out.stderr or out.stdout).strip().splitlines()[-5:]
            raise NativeBuildError(f"building the native kernels failed ({' '.join(cmd)}): " + " | ".join(tail))
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: let every user of a shared $ONPOLICY_HOME load it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    lib.rowdot_chunked.argtypes = [_PTR, _INT, _I64, _PTR, _INT, _I64, _I64, _INT, _I64, _PTR, _I64, _I64, _INT,
                                   _I64, _I64, _INT, _INT]
    lib.rowdot_chunked.restype = None
    lib.rowdot_group.argtypes = [_PTR, _INT, _I64, _I64, _INT, _PTR, _INT, _I64, _INT, _INT]
    lib.rowdot_group.restype = _INT
    lib.rowdot_pack.argtypes = [_PTR, _INT, _I64, _I64, _INT, _I64, _PTR]
    lib.rowdot_pack.restype = None
    lib.rowdot_packed.argtypes = [_PTR, _INT, _I64, _INT, _I64, _INT, _PTR, _INT, _INT, _I64, _INT]
    lib.rowdot_packed.restype = _INT
    lib.rowdot_vector_path.argtypes = []
    lib.rowdot_vector_path.restype = _INT
    lib.attention_rows.argtypes = [_PTR, _INT, _I64, _I64, _PTR, _PTR, _INT, _I64, _PTR, _I64, _PTR, _PTR, _I64,
                                   _INT, _INT, _INT, _INT, ctypes.c_float, _PTR, _INT, _INT]
    lib.attention_rows.restype = _INT
    lib.attention_backward_rows.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64,
                                            _INT, _INT, _INT, ctypes.c_float, _PTR, _PTR, _PTR, _INT]
    lib.attention_backward_rows.restype = _INT
    lib.native_exp.argtypes = [_PTR, _PTR, _I64, _INT]
    lib.native_exp.restype = None
    _F = ctypes.c_float
    lib.rmsnorm_rows.argtypes = [_PTR, _INT, _I64, _PTR, _INT, _PTR, _INT, _I64, _I64, _F, _INT, _INT]
    lib.rope_rows.argtypes = [_PTR, _INT, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]
    lib.swiglu_rows.argtypes = [_PTR, _INT, _I64, _PTR, _INT, _I64, _PTR, _I64, _I64, _INT, _INT]
    lib.swiglu_backward_rows.argtypes = [_PTR, _INT, _I64, _PTR, _INT, _I64, _PTR, _INT, _I64, _PTR, _PTR, _I64, _I64,
                                         _INT]
    for fn in (lib.rmsnorm_rows, lib.rope_rows, lib.swiglu_rows, lib.swiglu_backward_rows):
        fn.restype = None
    return lib


def vector_path() -> bool:
    """Whether this CPU runs rowdot's AVX2+FMA path (the portable path gives the same bits)."""
    return bool(library().rowdot_vector_path())


def _operand_dtype_ok(t: Tensor) -> bool:
    """Whether the kernels read ``t`` in place: fp32 or bf16 on CPU."""
    return t.dtype in _OPERAND_DTYPES and t.is_cpu


def _operand(t: Tensor, name: str, dims: int = 2) -> Tensor:
    if t.is_contiguous() and t.dtype in _OPERAND_DTYPES and t.dim() == dims and t.is_cpu:
        return t  # the common case, checked first (this runs twice per linear of a decode step)
    if t.dim() != dims:
        raise ValueError(f"rowdot expects {dims}-D {name}, got shape {tuple(t.shape)}")
    if t.dtype == torch.float16:
        t = t.float()  # exact; rowdot reads fp32 and bf16
    if t.dtype not in _OPERAND_DTYPES:
        raise ValueError(f"rowdot supports fp32, bf16 and fp16 {name}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"rowdot runs on CPU tensors, {name} is on {t.device}")
    rows_ok = t.stride(-2) >= t.shape[-1] and (dims == 2 or t.stride(0) >= t.shape[1] * t.stride(1))
    return t if t.stride(-1) == 1 and rows_ok else t.contiguous()


def rowdot(x: Tensor, weight: Tensor, *, portable: bool = False, threads: int | None = None) -> Tensor:
    """``x [M, K] @ weight [N, K].T`` in fp32 (``[M, N]``), with rowdot's fixed order of additions:
    :func:`rowdot_chunks` with one chunk. ``x`` and ``weight`` may each be fp32, bf16 or fp16 and any
    row stride (a column slice of a wider tensor is read in place). ``portable`` runs the portable
    path; ``threads`` defaults to torch's."""
    x, weight = _operand(x, "x"), _operand(weight, "weight")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"rowdot: x has {x.shape[1]} columns, weight has {weight.shape[1]}")
    return rowdot_chunks(x, weight[None], fold=True, portable=portable, threads=threads)


def rowdot_chunks(x: Tensor, chunks: Tensor, *, fold: bool, round_bf16: bool = False, portable: bool = False,
                  threads: int | None = None) -> Tensor:
    """The canonical row-parallel reduction for ``x [M, C*Kc]`` and ``chunks [C, N, Kc]``: chunk ``c``'s
    partial is ``rowdot(x[:, c*Kc:(c+1)*Kc], chunks[c])`` (rounded to bf16 when ``round_bf16``, as the
    cast of a bf16 partial would); returns the partials ``[C, M, N]`` or, with ``fold``, their fp32
    sum left to right in chunk order ``[M, N]`` — the bits of the per-chunk calls and ``fold_chunks``."""
    x, chunks = _operand(x, "x"), _operand(chunks, "chunks", dims=3)
    c, n, kc = chunks.shape
    m = x.shape[0]
    if x.shape[1] != c * kc:
        raise ValueError(f"rowdot: x has {x.shape[1]} columns, {c} chunks of {kc} need {c * kc}")
    y = torch.empty(*((m, n) if fold else (c, m, n)), dtype=torch.float32)  # sizes as arguments: cheaper
    if m and n and c:
        library().rowdot_chunked(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0),
                                 chunks.data_ptr(), int(chunks.dtype == torch.bfloat16), chunks.stride(1),
                                 chunks.stride(0), c, kc, y.data_ptr(), n, 0 if fold else m * n, int(round_bf16),
                                 m, n, threads or torch.get_num_threads(), int(portable))
    return y


#: Most weights one ``rowdot_group`` call takes (``ROWDOT_GROUP`` in rowdot.c).
GROUP_MAX = 8


def rowdot_group(x: Tensor, weights: Sequence[Tensor], *, portable: bool = False, threads: int | None = None,
                 ) -> list[Tensor]:
    """``[rowdot(x, w) for w in weights]`` (fp32 ``[M, N_w]`` each) in one native call: the threads
    share the weights' rows as one list of tasks, and every element is computed as rowdot computes
    it, so each output has the bits of its own call. The weights share ``x``'s K and one dtype."""
    x = _operand(x, "x")
    ws = [_operand(w, "weight") for w in weights]
    if not 1 <= len(ws) <= GROUP_MAX:
        raise ValueError(f"rowdot_group takes 1 to {GROUP_MAX} weights, got {len(ws)}")
    k = x.shape[1]
    if any(w.shape[1] != k for w in ws) or len({w.dtype for w in ws}) != 1:
        raise ValueError(f"rowdot_group: x has {k} columns; the weights {[tuple(w.shape) for w in ws]} "
                         f"({sorted({str(w.dtype) for w in ws})}) need {k} columns and one dtype")
    m, n = x.shape[0], len(ws)
    ys = [torch.empty(m, w.shape[0], dtype=torch.float32) for w in ws]
    if m:
        meta = array("q", [*(w.data_ptr() for w in ws), *(w.stride(0) for w in ws), *(w.shape[0] for w in ws),
                           *(y.data_ptr() for y in ys)])
        rc = library().rowdot_group(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), k, n,
                                    meta.buffer_info()[0], int(ws[0].dtype == torch.bfloat16), m,
                                    threads or torch.get_num_threads(), int(portable))
        if rc != 0:
            raise ValueError(f"rowdot_group: the kernel refused a group of {n} weights")
    return ys


def packable(weight: Tensor, chunks: int = 1) -> bool:
    """Whether :func:`pack` takes ``weight`` with ``chunks`` chunks: an fp32 (bf16) CPU matrix whose
    chunks are a multiple of 8 (16) columns, on a CPU that runs the vector path (the packed kernel's
    only path)."""
    step = 16 if weight.dtype == torch.bfloat16 else 8
    return (weight.dtype in _OPERAND_DTYPES and weight.dim() == 2 and weight.is_cpu and chunks >= 1
            and weight.shape[1] % (step * chunks) == 0 and weight.stride(1) == 1 and vector_path())


def pack(weight: Tensor, chunks: int = 1) -> Tensor:
    """``weight [N, chunks*K]`` packed for :func:`rowdot_packed` (``rowdot.c`` states the layouts): a
    fresh tensor of ``ceil(N / 8) * 8 * chunks * K`` elements' bytes — fp32 for an fp32 weight, int32
    words of two bf16 each (pair-packed) for a bf16 one."""
    if not packable(weight, chunks):
        raise ValueError(f"pack takes an fp32 or bf16 CPU [N, K] weight with K a multiple of 8 (fp32) or 16 (bf16) "
                         f"times chunks on an AVX2 CPU, got {weight.dtype} {tuple(weight.shape)} with {chunks} chunks")
    n, k = weight.shape
    bf16 = weight.dtype == torch.bfloat16
    out = torch.empty(-(-n // 8) * 8 * k // (2 if bf16 else 1), dtype=torch.int32 if bf16 else torch.float32)
    library().rowdot_pack(weight.data_ptr(), int(bf16), weight.stride(0), n, chunks, k // chunks, out.data_ptr())
    return out


def rowdot_packed(x: Tensor, packed: Sequence[tuple[Tensor, int]], *, chunks: int = 1, round_bf16: bool = False,
                  threads: int | None = None) -> list[Tensor]:
    """The folded :func:`rowdot_chunks` of ``x [M, chunks*K]`` with each packed weight (``(pack(w,
    chunks), rows of w)``, all from fp32 or all from bf16 weights), in one call: fp32 ``[M, rows]``
    each, the same bits."""
    x = _operand(x, "x")
    if not 1 <= len(packed) <= GROUP_MAX or len({w.dtype for w, _ in packed}) != 1:
        raise ValueError(f"rowdot_packed takes 1 to {GROUP_MAX} packed weights of one dtype")
    bf16 = packed[0][0].dtype == torch.int32
    m, k = x.shape
    if chunks < 1 or k % ((16 if bf16 else 8) * chunks):
        raise ValueError(f"rowdot_packed: x has {k} columns, not {chunks} chunks of the packed layout's multiple")
    for w, n in packed:
        size = -(-n // 8) * 8 * k // (2 if bf16 else 1)
        if w.dtype not in (torch.int32, torch.float32) or not w.is_contiguous() or w.numel() != size:
            raise ValueError(f"rowdot_packed: a packed weight of {n} rows and {k} columns has {size} "
                             f"elements, got {w.dtype} {tuple(w.shape)}")
    ys = [torch.empty(m, n, dtype=torch.float32) for _, n in packed]
    meta = array("q", [*(w.data_ptr() for w, _ in packed), *(n for _, n in packed), *(y.data_ptr() for y in ys)])
    rc = library().rowdot_packed(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), chunks, k // chunks,
                                 len(packed), meta.buffer_info()[0], int(bf16), int(round_bf16), m,
                                 threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError("rowdot_packed: the kernel refused (it needs the AVX2 path)")
    return ys


def _grad_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of a backward pass, in fp32: bf16 operands are widened (exact) and multiplied with
    fp32 accumulation, one rounding when the caller casts the result. torch's bf16 GEMM accumulates
    in fp32 too, but on a CPU without bf16 instructions it runs about 100× slower than the fp32 one
    (gradients carry no bitwise contract; this one is deterministic for a given shape)."""
    return a.float().mm(b.float())


class _Rowdot(torch.autograd.Function):
    """Forward: ``rowdot_chunks`` in ``x``'s dtype. Backward: the GEMMs of ``F.linear``'s backward
    in fp32 (``_grad_mm``), over the whole K when the partials are folded, per chunk otherwise."""

    @staticmethod
    def forward(ctx, x: Tensor, chunks: Tensor, fold: bool, round_bf16: bool) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, chunks)
        ctx.fold = fold
        return rowdot_chunks(x, chunks, fold=fold, round_bf16=round_bf16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        x, chunks = ctx.saved_tensors
        c, n, kc = chunks.shape
        grad = grad.float()  # widened once for both GEMMs
        gx = gw = None
        if ctx.fold:  # every chunk sees the same gradient: one GEMM over the whole K for each operand
            if ctx.needs_input_grad[0]:
                w = chunks[0] if c == 1 else chunks.transpose(0, 1).reshape(n, c * kc)
                gx = _grad_mm(grad, w).to(x.dtype)
            if ctx.needs_input_grad[1]:
                gw = _grad_mm(grad.t(), x).view(n, c, kc).transpose(0, 1).to(chunks.dtype)
            return gx, gw, None, None
        grads = list(grad)
        if ctx.needs_input_grad[0]:
            gx = torch.cat([_grad_mm(g, w) for g, w in zip(grads, chunks, strict=True)], 1).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = torch.stack([_grad_mm(g.t(), x[:, i * kc:(i + 1) * kc]) for i, g in enumerate(grads)])
            gw = gw.to(chunks.dtype)
        return gx, gw, None, None


def _apply(x: Tensor, chunks: Tensor, fold: bool, round_bf16: bool) -> Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or chunks.requires_grad):
        return _Rowdot.apply(x, chunks, fold, round_bf16)
    y = rowdot_chunks(x, chunks, fold=fold, round_bf16=round_bf16)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def chunked_linear(x: Tensor, chunks: Tensor, *, fold: bool) -> Tensor:
    """:func:`rowdot_chunks` in ``x``'s dtype (bf16 partials rounded before the fold), differentiable
    when autograd is on."""
    if x.dtype not in _OPERAND_DTYPES:
        raise ValueError(f"chunked_linear supports fp32 and bf16 activations, got {x.dtype}")
    return _apply(x, chunks, fold, x.dtype == torch.bfloat16)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in ``x``'s dtype through rowdot (fp32 accumulation, one rounding at the end),
    differentiable when autograd is on."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear expects x [N, K] and weight [Out, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    return _apply(x, weight[None], True, False)


class _RowdotGroup(torch.autograd.Function):
    """Forward: :func:`rowdot_group` in ``x``'s dtype (each output has its own ``linear``'s bits).
    Backward (fp32, as ``_Rowdot``'s): ``x``'s gradient accumulated GEMM by GEMM into one buffer
    (``addmm_``: no separate sum pass), each weight's gradient as its own GEMM."""

    @staticmethod
    def forward(ctx, x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)  # an unused output's weight gets None, as its own linear's would
        return tuple(y.to(x.dtype) for y in rowdot_group(x, weights))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        gs = [None if g is None else g.float() for g in grads]  # each widened once for both GEMMs
        used = [(g, w) for g, w in zip(gs, weights, strict=True) if g is not None]
        gx = None
        if ctx.needs_input_grad[0] and used:
            gx = _grad_mm(*used[0])
            for g, w in used[1:]:
                gx.addmm_(g, w.float())
            gx = gx.to(x.dtype)
        xf = x.float() if any(ctx.needs_input_grad[1:]) else x
        gws = [_grad_mm(g.t(), xf).to(w.dtype) if need and g is not None else None
               for g, w, need in zip(gs, weights, ctx.needs_input_grad[1:], strict=True)]
        return (gx, *gws)


def linears(x: Tensor, weights: Sequence[Tensor]) -> list[Tensor]:
    """The projections ``[linear(x, w) for w in weights]`` of one input (q/k/v, gate/up) in ``x``'s
    dtype, with the same bits: one :func:`rowdot_group` call (differentiable under autograd:
    ``_RowdotGroup``), or one ``linear`` per weight when the group does not fit the kernel (the
    weights' dtypes differ, more than ``GROUP_MAX``)."""
    if (x.dtype not in _OPERAND_DTYPES or not 1 <= len(weights) <= GROUP_MAX
            or len({w.dtype for w in weights}) != 1):
        return [linear(x, w) for w in weights]
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return list(_RowdotGroup.apply(x, *weights))  # rowdot_group checks the shapes
    ys = rowdot_group(x, weights)  # checks the shapes
    return ys if x.dtype == torch.float32 else [y.to(x.dtype) for y in ys]
