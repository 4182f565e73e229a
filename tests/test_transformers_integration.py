"""attn_implementation="cute" for transformers models, on CPU (the kernels' reference path):
the registration, the mask function's contract, and models that match transformers' own eager
attention -- causal (Llama), sliding window (Qwen2), soft-capping + window (Gemma 2), padded
batches on either side (the ops' key ranges, no fallback), masks with holes (the op's attn_mask
path; with softcap PyTorch's masked path, counted as a fallback)."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import torch_cute_ops as tco  # noqa: E402
from torch_cute_ops.integrations import transformers as cute_hf  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def build(kind: str, implementation: str):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=7, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=7, query_pre_attn_scalar=16,
                                           attn_logit_softcapping=5.0)
        model = transformers.Gemma2ForCausalLM(config)
    model.config._attn_implementation = implementation
    return model.double().eval()


class _CuteOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ran = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "cute":
            self.ran.add(func._opname)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def op_counter():
    """The names of the cute ops that ran inside the block."""
    with _CuteOps() as mode:
        yield mode.ran


def loss_of(model, ids, mask=None):
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def test_registered_with_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["cute"] is cute_hf.cute_attention_forward
    assert AttentionMaskInterface._global_mapping["cute"] is cute_hf.cute_mask


def test_mask_function_hands_over_padding_only():
    full = torch.ones(2, 10, dtype=torch.bool)
    assert cute_hf.cute_mask(2, torch.arange(10), 10, attention_mask=full) is None
    assert cute_hf.cute_mask(2, torch.arange(10), 10) is None
    padded = full.clone()
    padded[1, 7:] = False
    assert torch.equal(cute_hf.cute_mask(2, torch.arange(10), 10, attention_mask=padded), padded)


def test_sliding_window_maps_to_flash_attention_bounds():
    # transformers: query i sees key j iff i - W < j <= i, i.e. (left, right) = (W - 1, 0)
    assert cute_hf._window(None, True) == (-1, -1)
    assert cute_hf._window(4096, True) == (4095, 0)
    assert cute_hf._window(8, False) == (7, 7)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_models_match_transformers_eager_attention(kind):
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = loss_of(build(kind, "eager"), ids)
    tco.ops.fallback.reset()
    ours = loss_of(build(kind, "cute"), ids)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)  # eager upcasts softmax to fp32
    assert not tco.fallback_counts()


def test_key_range_of_a_padding_mask():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]])
    start, end = cute_hf.key_range(mask, 5)
    assert start.dtype == end.dtype == torch.int32
    assert start.tolist() == [0, 2, 0, 5, 1] and end.tolist() == [3, 5, 5, 5, 3]
    start, end = cute_hf.key_range(mask, 3)  # the last kv_length columns
    assert start.tolist() == [0, 0, 0, 3, 0] and end.tolist() == [1, 3, 3, 3, 1]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_runs_on_the_ops_without_a_mask(side):
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 19, dtype=torch.long)
    if side == "right":
        mask[0, 12:] = 0
    else:
        mask[0, :7] = 0
    for kind in ("llama", "qwen2", "gemma2"):
        # transformers' eager attention gives NaN on rows that see no key (left padding): compare
        # with its SDPA attention, which guards those rows
        ref = loss_of(build(kind, "sdpa"), ids, mask)
        assert ref.isfinite()
        tco.ops.fallback.reset()
        ours = loss_of(build(kind, "cute"), ids, mask)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert not tco.fallback_counts()


def test_mask_with_holes_runs_the_ops_attn_mask_path():
    """Two runs of real tokens in a row: transformers' materialized mask goes to the attention op
    (its attn_mask path), with no fallback; with softcap (Gemma 2) it takes PyTorch's and says so."""
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, 5:8] = 0  # a hole: two runs of real tokens
    ref = loss_of(build("llama", "eager"), ids, mask)
    tco.ops.fallback.reset()
    with op_counter() as ran:
        ours = loss_of(build("llama", "cute"), ids, mask)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert not tco.fallback_counts() and "flash_attn_fwd" in ran
    ref = loss_of(build("gemma2", "eager"), ids, mask)
    tco.ops.fallback.reset()
    ours = loss_of(build("gemma2", "cute"), ids, mask)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert [op for op, _ in tco.fallback_counts()] == ["transformers attention"]


def test_generate_decodes_with_the_cache():
    model = build("llama", "cute")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    ours = model.generate(ids, max_new_tokens=6, do_sample=False)
    ref = build("llama", "eager").generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_with_a_static_cache_hides_unwritten_slots(kind):
    """A preallocated cache is longer than the tokens written so far: those slots must not be
    attended to (prefill and every decode step), with and without a 2-D mask, batched."""
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ref = build(kind, "eager").generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        cache_implementation="static")
    tco.ops.fallback.reset()
    ours = build(kind, "cute").generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        cache_implementation="static")
    assert torch.equal(ours, ref)
    assert not tco.fallback_counts()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_generate_with_a_static_cache_and_left_padding_attends_through_the_kvcache_op(kind):
    """Batched generate with left padding into a static cache: each row's keys are its run of real,
    written ones (no mask materialized), attended through flash_attn_kvcache with cache_leftpad
    (windows and Gemma 2's softcap included)."""
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ref = build(kind, "sdpa").generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                       cache_implementation="static")
    tco.ops.fallback.reset()
    with op_counter() as ran:
        ours = build(kind, "cute").generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                            cache_implementation="static")
    assert torch.equal(ours, ref)
    assert not tco.fallback_counts() and "flash_attn_kvcache" in ran


def test_layers_share_one_key_range_per_mask(monkeypatch):
    from torch_cute_ops.runtime.lasting import PerTensor

    """Every layer gets the same mask tensor: its key ranges are computed once (and the kvcache op
    checks their values once per forward), again after the mask changes, gone with the mask."""
    import gc

    monkeypatch.setattr(cute_hf, "_key_ranges", PerTensor())
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    first = cute_hf.shared_key_range(mask, 6)
    assert cute_hf.shared_key_range(mask, 6) is first
    assert first[0].tolist() == [2, 0] and first[1].tolist() == [6, 6]
    mask[1, :3] = 0
    assert cute_hf.shared_key_range(mask, 6)[0].tolist() == [2, 3]
    del mask
    gc.collect()
    assert len(cute_hf._key_ranges) == 0


def test_written_keys_hide_unwritten_slots_and_padding():
    positions = torch.arange(4, 7)  # three queries, the last at position 6
    assert cute_hf.written_keys(2, positions, 10, 0, None).tolist() == [[True] * 7 + [False] * 3] * 2
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, :2] = 0
    keys = cute_hf.written_keys(2, positions, 10, 0, padding)
    assert keys[0].tolist() == [True] * 7 + [False] * 3
    assert keys[1].tolist() == [False] * 2 + [True] * 5 + [False] * 3
    shifted = cute_hf.written_keys(2, positions, 4, 3, padding)  # slots hold positions 3..6
    assert shifted.tolist() == [[True] * 4, [True] * 4]


def test_unwritten_keys_are_told_by_shapes_or_positions():
    positions = torch.arange(4, 7)
    assert cute_hf._unwritten_keys(positions, 10, 0, torch.ones(2, 7))  # static cache, mask given
    assert not cute_hf._unwritten_keys(positions, 7, 0, torch.ones(2, 7))  # dynamic cache
    assert cute_hf._unwritten_keys(positions, 10, 0, None)  # no mask: the last position tells
    assert not cute_hf._unwritten_keys(positions, 7, 0, None)
    assert not cute_hf._unwritten_keys(torch.arange(7), 7, 0, None)


def test_versions_outside_the_tested_range_are_refused_clearly():
    cute_hf._check_version("4.57.6")
    cute_hf._check_version("4.56.0.dev0")
    for version in ("4.55.4", "5.0.0", "5.1.0rc1"):
        with pytest.raises(ImportError, match=r"transformers>=4.56,<5; found " + version.replace(".", r"\.")):
            cute_hf._check_version(version)


def _static_decode_logits(kind: str, implementation: str, compiled: bool) -> torch.Tensor:
    """Prefill a left-padded batch into a static cache, then three decode steps (compiled with
    fullgraph=True when asked): their last logits."""
    model = build(kind, implementation)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, cache_position=torch.arange(9))
        step = torch.compile(model.forward, fullgraph=True, backend="aot_eager") if compiled else model.forward
        for t in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            out = step(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache,
                       cache_position=torch.tensor([9 + t]))
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_compiled_static_cache_decode_step_traces_whole(kind):
    """A decode step into a static cache with left padding compiles with fullgraph=True (the
    written-keys mask, key ranges and the kvcache op trace without a break) and gives sdpa's logits."""
    ref = _static_decode_logits(kind, "sdpa", compiled=False)
    torch.testing.assert_close(_static_decode_logits(kind, "cute", compiled=True), ref, rtol=1e-6, atol=1e-6)


def test_mask_verdicts_are_read_once_per_prompt_and_a_continuation_that_gains_a_hole_is_caught(monkeypatch):
    """The verdict logic eager GPU decoding takes, exercised on the CPU (where a read-back is free
    and the verdict is normally read every time): a prompt is read back once; its decode steps
    inherit the verdict without a read-back; a continued mask that gains a hole fails the
    assertion (on a GPU: a device-side assertion, no sync); a prompt whose rows end in padding is
    not carried on."""
    from torch_cute_ops.integrations import transformers as cute_hf

    verdicts = cute_hf._MaskVerdicts()
    monkeypatch.setattr(cute_hf._MaskVerdicts, "carries", staticmethod(lambda mask: True))
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    prompt = torch.ones(2, 6, dtype=torch.long)
    prompt[1, :2] = 0  # left padding: one run per row, every row ends real
    assert verdicts.get(prompt, 6) == "one run" and len(reads) == 1
    step = torch.cat([prompt, torch.ones(2, 1, dtype=torch.long)], 1)
    assert verdicts.get(step, 1) == "one run" and len(reads) == 1  # inherited: no read-back
    holed = torch.cat([step, torch.ones(2, 1, dtype=torch.long)], 1)
    holed[0, 3] = 0
    with pytest.raises(RuntimeError):
        verdicts.get(holed, 1)
    right_padded = torch.ones(2, 5, dtype=torch.long)
    right_padded[0, 3:] = 0
    assert verdicts.get(right_padded, 5) == "one run" and len(reads) == 2
    assert verdicts.get(torch.cat([right_padded, torch.ones(2, 1, dtype=torch.long)], 1), 1) == "holes"
    assert len(reads) == 3  # not carried on: read back, and its hole found
