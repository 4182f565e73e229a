"""What the property-based fuzz tests (tests/test_fuzz_*.py, bench/fuzz_memcheck.py) share.

Every fuzzed call obeys one rule (:func:`expect`): a valid input returns results that match a
float64 reference written here (independent of ``torch_cute_ops.reference``) within a tolerance
that follows the dtypes, with no NaN from finite inputs; an invalid input raises ValueError,
TypeError or NotImplementedError whose message starts with the offending argument's name
("q: ...", "key_start, key_end: ..."). Any other exception, or a call that runs past
``CALL_LIMIT_S``, fails the case.

Example counts come from the ``torch-cute-ops-ci`` hypothesis profile (derandomized, no example
database: CI runs the same cases every time), scaled by ``TORCH_CUTE_OPS_FUZZ_SCALE`` (e.g. 5 for
a longer GPU run, 0.2 under compute-sanitizer). ``TORCH_CUTE_OPS_FUZZ_EXPLORE=1`` draws fresh
cases instead (``pytest --hypothesis-seed=N`` repeats a run; a failure prints its reproduce blob).
:data:`TALLY` counts the cases tried and failed; tests/conftest.py prints it at the end of a
pytest run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import threading
from dataclasses import dataclass, field

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXPLORE = os.environ.get("TORCH_CUTE_OPS_FUZZ_EXPLORE", "0") == "1"
settings.register_profile(  # no "explain" phase: it traces every line of a failing case's replays (slow)
    "torch-cute-ops-ci", max_examples=40, deadline=None, derandomize=not EXPLORE, database=None, print_blob=EXPLORE,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
SCALE = float(os.environ.get("TORCH_CUTE_OPS_FUZZ_SCALE", "1"))
# a call past this is a hang (on a GPU the first call of a kernel variant compiles it: minutes at worst)
CALL_LIMIT_S = float(os.environ.get("TORCH_CUTE_OPS_FUZZ_CALL_LIMIT_S", "600" if torch.cuda.is_available() else "60"))
NAMED_ERRORS = (ValueError, TypeError, NotImplementedError)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def fuzz_settings(examples: int = 40) -> settings:
    """The CI profile with ``examples`` cases (times TORCH_CUTE_OPS_FUZZ_SCALE)."""
    return settings(settings.get_profile("torch-cute-ops-ci"), max_examples=max(1, round(examples * SCALE)))


def fuzz_property(examples: int = 40):
    """A property test over cases drawn from ``data``: hypothesis's ``given`` under
    :func:`fuzz_settings`, each case counted in :data:`TALLY`."""
    def wrap(test):
        return fuzz_settings(examples)(given(data=st.data())(tallied(test)))
    return wrap


# ------------------------------------------------------------------------------------ tally

@dataclass
class Tally:
    """Cases tried and failed per test (a pytest node id). Once a test has failed, hypothesis
    replays and shrinks its failure: those runs are not counted again."""
    cases: int = 0
    failed: dict = field(default_factory=dict)  # test id -> the first failure's message

    def summary(self) -> str:
        text = f"fuzz: {self.cases} cases tried, {len(self.failed)} failures"
        return text + "".join(f"\n  {test}: {message}" for test, message in sorted(self.failed.items()))


TALLY = Tally()


RUNNING: list[str] = []  # the label of the property a script (bench/fuzz_memcheck.py) runs


def tallied(test):
    """Count each case the wrapped property runs, and the first that fails in each test."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        test_id = RUNNING[-1] if RUNNING else os.environ.get("PYTEST_CURRENT_TEST", test.__name__).rsplit(" ", 1)[0]
        counted = test_id not in TALLY.failed
        try:
            result = test(*args, **kwargs)
        except (Exception, pytest.fail.Exception) as e:  # pytest.fail's is a BaseException
            if counted and type(e).__name__ != "UnsatisfiedAssumption":  # hypothesis's control flow, as StopTest
                TALLY.cases += 1
                TALLY.failed[test_id] = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise
        TALLY.cases += counted
        return result
    return run


# ---------------------------------------------------------------------------- the outcome rule

@dataclass
class Case:
    """One drawn call: its arguments and, for an invalid one, the argument names its error may cite."""
    kwargs: dict
    error: tuple[str, ...] | None = None
    note: str = ""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail a call that does not return in time (a hang), where SIGALRM exists."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(*_):
        raise AssertionError(f"hang: the call ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def strict_mode(on: bool):
    """TORCH_CUTE_OPS_STRICT for one call (hypothesis runs many cases in one test: no fixture)."""
    previous = os.environ.get("TORCH_CUTE_OPS_STRICT")
    os.environ["TORCH_CUTE_OPS_STRICT"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_CUTE_OPS_STRICT"]
        else:
            os.environ["TORCH_CUTE_OPS_STRICT"] = previous


def cited_names(message: str) -> set[str]:
    """The argument names a message starts with: "k, v: give both" -> {"k", "v"}."""
    head, sep, _ = message.partition(":")
    return {name.strip() for name in head.split(",")} if sep else set()


def expect(call, error: tuple[str, ...] | None, note: str = ""):
    """Run ``call``. ``error`` None: it must return (its result is returned). Otherwise it must raise
    a named error citing one of ``error``'s names (None is returned)."""
    try:
        with time_limit(CALL_LIMIT_S):
            result = call()
    except NAMED_ERRORS as e:
        if error is None:
            raise AssertionError(f"a valid input was rejected ({note}): {type(e).__name__}: {e}") from e
        cited = cited_names(str(e))
        assert cited & set(error), f"the error should name one of {error} ({note}), got {type(e).__name__}: {e}"
        return None
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"crashed with {type(e).__name__} ({note}): {e}") from e
    assert error is None, f"an invalid input was accepted ({note}): expected an error naming one of {error}"
    return result


# ---------------------------------------------------------------------------------- comparing

def unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
            torch.bfloat16: 2.0**-8}[dtype]


def overflowed(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 reference as rounding to ``dtype`` leaves it: infinite past the largest finite
    value plus half its ulp (a result fp16 cannot hold is inf, not an error)."""
    info = torch.finfo(dtype)
    limit = info.max + 2.0 ** (math.floor(math.log2(info.max)) + math.log2(info.eps) - 1)
    return torch.where(ref.abs() >= limit, ref.sign() * math.inf, ref)


def assert_matches(name: str, ours: torch.Tensor, ref: torch.Tensor, atol, rtol: float) -> None:
    """Elementwise ``|ours - ref| <= atol + rtol |ref|`` against a float64 reference (atol a number
    or a tensor); infinities must match exactly and NaN never passes."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    ours = ours.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    assert not ours.isnan().any(), f"{name}: NaN from finite inputs ({int(ours.isnan().sum())} elements)"
    infinite = torch.isinf(ref)
    assert torch.equal(infinite, torch.isinf(ours)) and torch.equal(ours[infinite], ref[infinite]), \
        f"{name}: infinities differ from the reference's"
    bound = torch.as_tensor(atol).to("cpu", torch.float64).expand_as(ref) + rtol * ref.abs()  # atol may live on the GPU
    error = torch.where(infinite, 0.0, (ours - ref).abs())
    bad = error > bound
    if bad.any():
        worst = int((error - bound).flatten().argmax())
        raise AssertionError(f"{name}: {int(bad.sum())} of {ref.numel()} elements off; worst at flat index {worst}: "
                             f"{ours.flatten()[worst].item()} vs {ref.flatten()[worst].item()} "
                             f"(bound {bound.flatten()[worst].item():.3g})")


def assert_close_norm(name: str, ours: torch.Tensor, ref: torch.Tensor, rel: float, atol: float = 0.0) -> None:
    """Frobenius error (gradients): ``|ours - ref| <= rel (|ref| + 1e-3 sqrt(n)) + atol``; no NaN."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    ours = ours.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    assert not ours.isnan().any(), f"{name}: NaN from finite inputs"
    floor = 1e-3 * math.sqrt(max(ref.numel(), 1))
    err = (ours - ref).norm().item()
    assert err <= rel * (ref.norm().item() + floor) + atol, \
        f"{name}: error {err:.3g}, relative {err / (ref.norm().item() + floor):.3g} (atol {atol:.3g})"


# ------------------------------------------------------------------------------ tensor layouts

@st.composite
def layouts(draw, ndim: int, expanded: bool = True):
    """How a tensor of ``ndim`` dims lies in memory: contiguous, a permuted view (transposed), a
    sliced view (padding, steps, an offset) or an expanded one (a stride 0)."""
    kinds = ["contiguous", "permuted", "sliced"] + (["expanded"] if expanded and ndim else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "permuted" and ndim > 1:
        return kind, tuple(draw(st.permutations(range(ndim))))
    if kind == "sliced" and ndim:
        return kind, draw(st.integers(0, ndim - 1)), draw(st.integers(1, 3)), draw(st.integers(0, 2))
    if kind == "expanded":
        return kind, draw(st.integers(0, ndim - 1))
    return ("contiguous",)


def differentiable(*tensors) -> bool:
    """Whether the tensors can require grad (floating point), so an invalid call can take the
    dispatcher's autograd path too."""
    return all(t is None or t.is_floating_point() for t in tensors)


def values(shape, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale


def make(shape, dtype: torch.dtype, device, gen: torch.Generator, layout=("contiguous",), scale: float = 1.0,
         fill=None) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` laid out as ``layout`` says, with normal values times
    ``scale`` (or ``fill(shape)``'s float64 values)."""
    shape = tuple(shape)
    fill = fill or (lambda s: values(s, gen, scale))
    kind = layout[0]
    if kind == "permuted":
        perm = layout[1]
        base = fill([shape[p] for p in perm])
        out = base.permute([perm.index(d) for d in range(len(shape))])
    elif kind == "sliced":
        dim, step, offset = layout[1:]
        big = list(shape)
        big[dim] = shape[dim] * step + offset
        index = [slice(None)] * len(shape)
        index[dim] = slice(offset, offset + shape[dim] * step, step)
        out = fill(big)[tuple(index)]
    elif kind == "expanded":
        dim = layout[1]
        small = list(shape)
        small[dim] = 1
        out = fill(small).expand(shape)
    else:
        out = fill(shape)
    return _cast(out, dtype, device)


def _cast(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """``t`` in ``dtype`` on ``device`` with its strides kept (a view of a converted base)."""
    if t.numel() == 0 or t.dim() == 0:
        return t.to(dtype=dtype, device=device)
    base = t
    while base._base is not None:
        base = base._base
    if dtype.is_floating_point and dtype.itemsize == 1:
        base = base.clamp(-200.0, 200.0)  # inside every FP8 format's range (out-of-range e4m3 is NaN)
    converted = base.to(dtype=dtype, device=device)
    return converted.as_strided(t.shape, t.stride(), t.storage_offset())


def seeds():
    return st.integers(0, 2**31 - 1)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- float64 references

ACTIVATIONS64 = {
    None: lambda x: x,
    "relu": torch.relu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


def masked_softmax64(scores: torch.Tensor, visible: torch.Tensor | None):
    """Softmax over the last dim and its log-sum-exp, where ``visible`` (broadcast) allows and the
    score is not -inf; a row with nothing visible gives probabilities 0 and lse -inf (gradients
    flow, and stay finite, through every other row)."""
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    safe = scores.masked_fill(empty, 0.0)
    probs = torch.softmax(safe, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return probs, lse


def attention64(q, k, v, scale, causal=False, left=None, right=None, softcap=0.0, key_start=None, key_end=None,
                attn_mask=None):
    """(B, S, H, D) attention in float64: GQA, causal and windows aligned bottom-right (query i
    at key position i + S_k - S_q sees keys in [pos - left, pos + right]), soft-capping, a padded
    batch (entry b's real keys and queries at key positions [key_start[b], key_end[b])), PyTorch's
    attn_mask (bool: True attends; float: added to the scores). Returns out (B, S_q, H_q, D) and
    lse (B, H_q, S_q)."""
    q, k, v = (t.to("cpu", torch.float64) for t in (q, k, v))
    batch, s_q, heads, _ = q.shape
    s_k = k.shape[1]
    group = heads // k.shape[2] if k.shape[2] else 1
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(s_q)[:, None] + (s_k - s_q)
    j = torch.arange(s_k)[None, :]
    if causal:
        right = 0 if right is None else min(right, 0)
    visible = torch.ones(s_q, s_k, dtype=torch.bool)
    if right is not None:
        visible &= j <= pos + right
    if left is not None:
        visible &= j >= pos - left
    visible = visible[None, None]
    if key_start is not None:
        start = key_start.to("cpu", torch.int64)[:, None, None, None]
        end = key_end.to("cpu", torch.int64)[:, None, None, None]
        visible = visible & (j >= start) & (j < end) & (pos >= start) & (pos < end)
    if attn_mask is not None:
        mask = attn_mask.to("cpu")
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            scores = scores + mask.double()
    probs, lse = masked_softmax64(scores, visible)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def score_eps(dtype: torch.dtype, device, softcap: float) -> float:
    """The relative error of a scaled score: fp32 (fp64) arithmetic, and on a GPU the kernels'
    approximate tanh when capped."""
    work = unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)
    if torch.device(device).type == "cuda":
        return max(1024 * work, 2.0**-10 if softcap else 0.0)
    return 64 * work


def attention_tolerance(dtype: torch.dtype, device, v: torch.Tensor, smax: float, softcap: float = 0.0):
    """(atol, rtol) of an attention output against the float64 reference: rounding to ``dtype``
    (the kernels also round P to it), and the scores' error (:func:`score_eps`)."""
    vmax = v.abs().max().item() if v.numel() else 0.0
    atol = (4 * unit_roundoff(dtype) + score_eps(dtype, device, softcap) * (1 + smax)) * vmax + 1e-300
    return atol, 2 * unit_roundoff(dtype)


def lse_tolerance(dtype: torch.dtype, device, lse_ref: torch.Tensor, smax: float, softcap: float = 0.0):
    finite = lse_ref.abs().masked_fill(torch.isinf(lse_ref), 0.0)
    return 4 * score_eps(dtype, device, softcap) * (1 + smax + finite), 0.0


def attention_grad_atol(q, k, v, dout, scale) -> float:
    """The backward's delta = rowsum(dO * O) reads O rounded to q's dtype: an error of u |dO| |O|
    per row that reaches dQ and dK times |scale| max|k| (max|q|) D whatever the gradients' own
    size (they can cancel to nothing): a Frobenius bound of 4 u |scale| D max|v| max(|q|, |k|) |dO|."""
    if min(q.numel(), k.numel(), v.numel()) == 0:
        return 0.0
    peak = max(q.abs().max().item(), k.abs().max().item())
    return 4 * unit_roundoff(q.dtype) * abs(scale) * q.shape[-1] * v.abs().max().item() * peak * \
        dout.double().norm().item()


def grad_tolerance(dtype: torch.dtype, device, softcap: float = 0.0) -> float:
    """Relative (Frobenius) error allowed of a gradient (on a GPU with softcap, the backward
    recovers tanh from P with approximate logarithms: 4 times more)."""
    on_gpu = torch.device(device).type == "cuda"
    rel = {torch.float64: 1e-9, torch.float32: 1e-3 if on_gpu else 1e-4, torch.float16: 1e-2,
           torch.bfloat16: 5e-2}[dtype]
    return rel * (4 if on_gpu and softcap else 1)


def max_score(q, k, scale, softcap: float = 0.0) -> float:
    """A bound on |scaled score|: max |q| |k| D |scale| (cheap, loose), at most softcap when capped."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    bound = q.abs().max().item() * k.abs().max().item() * q.shape[-1] * abs(scale)
    return min(bound, softcap) if softcap else bound


# ------------------------------------------------------------------------- attention strategies

def seqlens(device):
    """Sequence lengths: short ones (0 included); on a GPU also across the kernels' 64/128-row tiles."""
    small = st.integers(0, 9)
    return small if device == "cpu" else st.one_of(small, st.sampled_from([63, 64, 65, 128, 129, 200]))


def head_dims(device):
    """Head dims: small ones on the CPU; on a GPU the kernels' (64, 96, 128, 256) and one they lack."""
    return st.sampled_from([1, 3, 8, 16] if device == "cpu" else [8, 64, 96, 128, 256])


@st.composite
def attention_options(draw, public: bool):
    """softmax_scale, causal, the window and softcap (valid values; invalid softcaps are
    tests/test_fuzz_cached_checks.py's). Public: window_size as FlashAttention's (-1 unbounded);
    the ops: window_left/right any ints or None."""
    scale = draw(st.sampled_from(([None] if public else []) + [0.0, -0.3, 0.125, 1.0, 2.5]))
    causal = draw(st.booleans())
    far = st.sampled_from([2**31, 2**40]) if public else st.sampled_from([2**31, 2**40, -2**40])
    bound = st.one_of(st.integers(-1, 10), far) if public else st.one_of(st.none(), st.integers(-12, 12), far)
    left, right = (draw(bound), draw(bound)) if draw(st.booleans()) else ((-1, -1) if public else (None, None))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.5, 5.0, 1e4, 1e-30]))
    return dict(softmax_scale=scale, causal=causal, left=left, right=right, softcap=softcap)


def op_bound(value):
    """A public window bound (-1: unbounded) as the op's (None: unbounded)."""
    return None if value == -1 else value


def scale_of(options, head_dim: int) -> float:
    return options["softmax_scale"] if options["softmax_scale"] is not None else head_dim ** -0.5


INVALID_WINDOWS = [(-2, 0), (0,), "ab", (1.5, 0), (True, 0), None, (0, -5)]
INVALID_SCALES = [(float("nan"), ValueError), (float("inf"), ValueError), ([0.5], TypeError)]


def index_tensor(values, device, strided: bool, dtype=torch.int32, shape=None) -> torch.Tensor:
    """An index tensor (lengths, offsets, a page table) with ``values`` (of ``shape``, when given):
    contiguous, or a strided view whose gaps hold garbage (-7), so a kernel that ignores the
    strides reads wrong values."""
    t = torch.tensor(values, dtype=dtype)
    t = t if shape is None else t.reshape(shape)
    if not strided or t.numel() == 0:
        return t.to(device)
    buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1] + 1), -7, dtype=dtype)
    buffer[..., 1::2] = t
    return buffer.to(device)[..., 1::2]
