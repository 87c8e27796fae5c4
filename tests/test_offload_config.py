"""The host KV tier's vLLM side (``infinitehip.offload``): sizing, the worker, the host store.

Pure parts (tier sizing, block tracking, the host store's CPU path, the KV allocation hook, the
config-time hook) run without an engine; then bad tier config fails at startup naming the field,
and one small engine runs with the tier on the CPU: capacity, and the releases after finish,
abort and preemption, checked against vLLM's own scheduler step by step.
"""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from vllm_infinitehip.block_manager.host_store import HostKVStore, mapped_bytes

from tests.conftest import ENGINE_KW, SMALL_HIP
from vllm_infinitehip.config import InfiniteHiPConfigError, OffloadConfig
from vllm_infinitehip.metrics import InfiniteHiPWorkerExtension
from vllm_infinitehip.worker import (
    BlockOwners,
    host_kv_allocation,
    size_host_tier,
    size_split_tier,
)

GIB = 1 << 30


# ---------------------------------------------------------------- sizing
def test_gpu_tier_defaults_to_most_of_the_host_and_all_of_the_profiled_budget():
    tier = size_host_tier(OffloadConfig(enabled=True), device_budget=30 * GIB,
                          available_host=100 * GIB)  # fmt: skip
    assert (tier.host_bytes, tier.bank_bytes) == (80 * GIB, 30 * GIB)
    # workers of one engine on one machine share its memory
    tier = size_host_tier(OffloadConfig(enabled=True), device_budget=30 * GIB,
                          available_host=100 * GIB, workers_on_host=4)  # fmt: skip
    assert tier.host_bytes == 20 * GIB


def test_gpu_tier_takes_explicit_sizes():
    tier = size_host_tier(OffloadConfig(enabled=True, host_gib=64, bank_gib=2.5),
                          device_budget=30 * GIB, available_host=100 * GIB)  # fmt: skip
    assert (tier.host_bytes, tier.bank_bytes) == (64 * GIB, int(2.5 * GIB))


def test_gpu_tier_refuses_what_does_not_fit_naming_the_field():
    with pytest.raises(InfiniteHiPConfigError, match=r"`infinitehip\.offload\.host_gib`=120"):
        size_host_tier(OffloadConfig(enabled=True, host_gib=120), device_budget=30 * GIB,
                       available_host=100 * GIB)  # fmt: skip
    with pytest.raises(InfiniteHiPConfigError, match=r"host_gib`=30 .* per worker, 4 workers"):
        size_host_tier(OffloadConfig(enabled=True, host_gib=30), device_budget=30 * GIB,
                       available_host=100 * GIB, workers_on_host=4)  # fmt: skip
    with pytest.raises(
        InfiniteHiPConfigError, match=r"`infinitehip\.offload\.bank_gib`=31 .*profiling"
    ):
        size_host_tier(OffloadConfig(enabled=True, bank_gib=31), device_budget=30 * GIB,
                       available_host=100 * GIB)  # fmt: skip
    with pytest.raises(InfiniteHiPConfigError, match=r"no GPU memory for the bank"):
        size_host_tier(OffloadConfig(enabled=True), device_budget=0, available_host=100 * GIB)


def test_split_layout_sizes_gpu_plus_host_and_names_the_field_that_does_not_fit():
    """Llama-3-8B fp8 blocks (1 MiB of K and V over 32 layers): 116 GiB on the GPU and 100 on
    the host hold 216 GiB of KV; ``gpu_gib`` caps the GPU side, which holds every block's K.
    (No V bank here: ``bank_gib`` 0; the next test sizes one.)"""
    split = OffloadConfig(enabled=True, layout="split", host_gib=100, bank_gib=0)
    mib = 1 << 20
    tier = size_split_tier(split, device_budget=116 * GIB, available_host=128 * GIB,
                           block_bytes=mib, min_gpu_pages=1024)  # fmt: skip
    assert tier.layout == "split" and tier.num_blocks == 216 * 1024
    assert tier.host_bytes == (tier.num_blocks - tier.gpu_pages) * mib // 2 <= 100 * GIB
    capped = size_split_tier(OffloadConfig(enabled=True, layout="split", host_gib=100,
                                           gpu_gib=40, bank_gib=0), device_budget=116 * GIB,
                             available_host=128 * GIB, block_bytes=mib,
                             min_gpu_pages=1024)  # fmt: skip
    # K of every block must fit the 40 GiB: K alone caps it, V of one step's blocks beside it
    assert (capped.num_blocks, capped.gpu_pages) == (40 * 2048 - 1024, 1024)
    assert capped.device_budget == 40 * GIB
    with pytest.raises(InfiniteHiPConfigError, match=r"`infinitehip\.offload\.gpu_gib`=200"):
        size_split_tier(OffloadConfig(enabled=True, layout="split", gpu_gib=200),
                        device_budget=116 * GIB, available_host=128 * GIB, block_bytes=mib,
                        min_gpu_pages=1024)  # fmt: skip
    with pytest.raises(InfiniteHiPConfigError, match=r"one step's new blocks"):
        size_split_tier(split, device_budget=100 * mib, available_host=128 * GIB,
                        block_bytes=mib, min_gpu_pages=1024)  # fmt: skip
    # landmark scores stay on the GPU beside K: 16 tokens x (8 + 1) x 4 bytes x 32 layers a block
    extra = 16 * 9 * 4 * 32
    scored = size_split_tier(split, device_budget=116 * GIB, available_host=128 * GIB,
                             block_bytes=mib, min_gpu_pages=1024,
                             gpu_block_extra=extra)  # fmt: skip
    assert scored.num_blocks < tier.num_blocks
    used = scored.num_blocks * (mib // 2 + extra) + scored.gpu_pages * mib // 2
    assert 0 <= 116 * GIB - used < mib + extra  # within the GPU, and no room for one block more


def test_split_layout_v_bank_comes_out_of_the_gpu_v_homes():
    """The V bank of the split layout: a sixteenth of the GPU's KV memory by default, or
    ``bank_gib``; its pages leave the GPU's V homes, so everything still fits the GPU, and a
    bank larger than the GPU's KV memory names the field."""
    mib = 1 << 20
    sizes = dict(device_budget=116 * GIB, available_host=128 * GIB, block_bytes=mib,
                 min_gpu_pages=1024)  # fmt: skip
    plain = size_split_tier(OffloadConfig(enabled=True, layout="split", host_gib=100,
                                          bank_gib=0), **sizes)  # fmt: skip
    assert plain.bank_pages == plain.bank_bytes == 0
    # the bank's pages are its slots and one spare
    for bank_gib, pages in ((None, 116 * GIB // 16 // (mib // 2)), (2.0, 2 * 2048)):
        tier = size_split_tier(OffloadConfig(enabled=True, layout="split", host_gib=100,
                                             bank_gib=bank_gib), **sizes)  # fmt: skip
        assert tier.bank_pages == pages - 1 and tier.bank_bytes == pages * mib // 2
        used = (tier.num_blocks * mib // 2 + tier.gpu_pages * mib // 2
                + tier.bank_bytes)  # fmt: skip
        assert 0 <= 116 * GIB - used < mib  # within the GPU, no room for one block more
        assert tier.gpu_pages < plain.gpu_pages and tier.num_blocks <= plain.num_blocks
        assert tier.host_bytes == (tier.num_blocks - tier.gpu_pages) * mib // 2 <= 100 * GIB
    with pytest.raises(InfiniteHiPConfigError, match=r"`infinitehip\.offload\.bank_gib`=200"):
        size_split_tier(OffloadConfig(enabled=True, layout="split", bank_gib=200), **sizes)
    # at most one copy per host page: a bank as large as the GPU leaves the GPU its homes' share
    huge = size_split_tier(OffloadConfig(enabled=True, layout="split", host_gib=100,
                                         bank_gib=115), **sizes)  # fmt: skip
    assert huge.bank_pages < plain.num_blocks - plain.gpu_pages and huge.gpu_pages >= 1024
    # too small for a slot beside its spare: no bank
    tiny = size_split_tier(OffloadConfig(enabled=True, layout="split", host_gib=100,
                                         bank_gib=0.0005), **sizes)  # fmt: skip
    assert tiny.bank_pages == tiny.bank_bytes == 0 and tiny.num_blocks == plain.num_blocks


def test_offload_layout_parses_and_bad_values_name_the_field():
    from vllm_infinitehip.config import InfiniteHiPConfig

    cfg = InfiniteHiPConfig.from_user({"offload": {"layout": "split", "gpu_gib": 8}})
    assert (cfg.offload.layout, cfg.offload.gpu_gib) == ("split", 8.0)
    with pytest.raises(InfiniteHiPConfigError, match=r"`infinitehip\.offload\.layout`='ram'"):
        InfiniteHiPConfig.from_user({"offload": {"layout": "ram"}})
    with pytest.raises(InfiniteHiPConfigError, match=r"`infinitehip\.offload\.gpu_gib` sizes"):
        InfiniteHiPConfig.from_user({"offload": {"gpu_gib": 8}})
    # the split layout's V bank may be off; the host layout's bank is the tier's cache
    off = InfiniteHiPConfig.from_user({"offload": {"layout": "split", "bank_gib": 0}})
    assert off.offload.bank_gib == 0.0
    with pytest.raises(InfiniteHiPConfigError, match=r"`infinitehip\.offload\.bank_gib`=0 must"):
        InfiniteHiPConfig.from_user({"offload": {"bank_gib": 0}})
    with pytest.raises(InfiniteHiPConfigError, match=r"bank_gib`=-1 must be a number of GiB, 0"):
        InfiniteHiPConfig.from_user({"offload": {"layout": "split", "bank_gib": -1}})


def test_key_row_share_parses_and_bad_values_name_the_field():
    from vllm_infinitehip.config import InfiniteHiPConfig

    assert InfiniteHiPConfig.from_user({"offload": True}).offload.key_row_share == 0.75
    cfg = InfiniteHiPConfig.from_user({"offload": {"bank_gib": 8, "key_row_share": 0.9}})
    assert cfg.offload.key_row_share == 0.9 and cfg.offload.bank_gib == 8.0
    for bad in (0, 1, 1.5, -0.1, True, "half"):
        with pytest.raises(InfiniteHiPConfigError, match=r"infinitehip\.offload\.key_row_share"):
            InfiniteHiPConfig.from_user({"offload": {"key_row_share": bad}})


def test_key_row_bank_sizes_from_its_share_and_gives_way_when_the_table_does_not_fit():
    """The row table (4 bytes per cache row and layer) and a refresh's list come first; the
    rest are slots. Llama-3-8B shapes, 72 GiB of bf16 host KV, 12 GiB for key rows."""
    from vllm_infinitehip.block_manager.key_rows import MAX_LISTED, KeyRowBank

    meta = torch.device("meta")
    pages = 72 * 2**30 // (32 * 64 * 1024)
    bank = KeyRowBank.sized(12 * 2**30, 32, pages, 16, 8, 128, torch.bfloat16, meta)
    assert bank.num_slots == 1409526 and bank.missed.shape == (32, MAX_LISTED)
    assert bank.nbytes <= 12 * 2**30
    assert KeyRowBank.sized(pages * 16 * 8 * 4 * 32, 32, pages, 16, 8, 128, torch.bfloat16,
                            meta) is None  # the table alone  # fmt: skip


def test_cpu_bank_is_a_share_of_the_tier_and_at_most_all_of_it():
    tier = size_host_tier(OffloadConfig(enabled=True, host_gib=8), device_budget=GIB,
                          available_host=100 * GIB, bank_on_host=True)  # fmt: skip
    assert (tier.host_bytes, tier.bank_bytes) == (8 * GIB, GIB)
    tier = size_host_tier(OffloadConfig(enabled=True, host_gib=8, bank_gib=8), device_budget=GIB,
                          available_host=100 * GIB, bank_on_host=True)  # fmt: skip
    assert tier.bank_bytes == 8 * GIB  # vLLM's own CPU budget does not bound it
    with pytest.raises(
        InfiniteHiPConfigError, match=r"`infinitehip\.offload\.bank_gib`=9 .*host_gib"
    ):
        size_host_tier(OffloadConfig(enabled=True, host_gib=8, bank_gib=9), device_budget=GIB,
                       available_host=100 * GIB, bank_on_host=True)  # fmt: skip


# ---------------------------------------------------------------- block tracking
def step(*, new=(), cached=(), resumed=(), finished=(), preempted=None, zero=None, copies=None):
    """One real ``SchedulerOutput`` of vLLM 0.26: ``new`` = (req_id, block ids per group),
    ``cached`` = (req_id, new block ids per group or None)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [
        NewRequestData(req_id=r, prompt_token_ids=[1], mm_features=[], sampling_params=None,
                       pooling_params=None, block_ids=b, num_computed_tokens=0, lora_request=None)
        for r, b in new
    ]  # fmt: skip
    so.scheduled_cached_reqs = CachedRequestData.make_empty()
    so.scheduled_cached_reqs.req_ids = [r for r, _ in cached]
    so.scheduled_cached_reqs.new_block_ids = [b for _, b in cached]
    so.scheduled_cached_reqs.resumed_req_ids = set(resumed)
    so.finished_req_ids = set(finished)
    so.preempted_req_ids = None if preempted is None else set(preempted)
    so.new_block_ids_to_zero = zero
    so.kv_cache_block_copies = None if copies is None else [KVCacheBlockCopy(*c) for c in copies]
    return so


def test_block_owners_release_a_requests_blocks_when_it_finishes():
    owners = BlockOwners()
    assert owners.released_by(step(new=[("a", ([1, 2],)), ("b", ([3],))])) == []
    assert owners.released_by(step(cached=[("a", ([4],)), ("b", None)])) == []
    assert owners.blocks == {"a": [1, 2, 4], "b": [3]}
    assert owners.released_by(step(cached=[("b", None)], finished=["a"])) == [1, 2, 4]
    assert owners.released_by(step(finished=["b", "never-scheduled"])) == [3]
    assert owners.blocks == {} and not owners.holders


def test_block_owners_keep_a_shared_prefix_until_its_last_holder_leaves():
    owners = BlockOwners()
    owners.released_by(step(new=[("a", ([1, 2],))]))
    owners.released_by(step(new=[("b", ([1, 5],))], cached=[("a", None)]))  # prefix hit on 1
    assert owners.released_by(step(cached=[("b", None)], finished=["a"])) == [2]
    assert owners.released_by(step(finished=["b"])) == [1, 5]


def test_block_owners_release_a_block_freed_and_handed_out_again_in_one_step():
    owners = BlockOwners()
    owners.released_by(step(new=[("a", ([1],))]))
    # vLLM freed a's block and gave it to c in the same scheduling step: new content
    assert owners.released_by(step(new=[("c", ([1],))], finished=["a"])) == [1]
    assert owners.blocks == {"c": [1]} and owners.holders == {1: 1}


def test_block_owners_follow_preemption_and_resumption():
    owners = BlockOwners()
    owners.released_by(step(new=[("a", ([1, 2],)), ("b", ([3],))]))
    assert owners.released_by(step(cached=[("b", ([4],))], preempted=["a"])) == [1, 2]
    # resumed: its new list replaces the old one (here the old one is gone already)
    assert owners.released_by(step(cached=[("a", ([2, 6],)), ("b", None)], resumed=["a"])) == []
    assert owners.blocks == {"a": [2, 6], "b": [3, 4]}
    # resumed without a reported preemption (vLLM's forced-preemption path): the old list goes
    assert owners.released_by(step(cached=[("a", ([7],))], resumed=["a"])) == [2, 6]
    assert owners.blocks["a"] == [7]


def test_block_owners_release_blocks_rewritten_outside_attention():
    owners = BlockOwners()
    owners.released_by(step(new=[("a", ([1, 2], [9]))]))  # two KV cache groups, one block pool
    assert owners.blocks == {"a": [1, 2, 9]}
    out = owners.released_by(step(cached=[("a", ([3], []))], zero=[3], copies=[(1, 8), (2, 3)]))
    assert out == [3, 8]
    assert owners.released_by(step(finished=["a"])) == [1, 2, 3, 9]


# ---------------------------------------------------------------- host store
def test_host_buffers_cost_their_size_rounded_to_a_page_not_a_power_of_two():
    page = mmap.PAGESIZE
    assert mapped_bytes(1) == page
    assert mapped_bytes(5 * page) == 5 * page
    assert mapped_bytes(5 * page + 1) == 6 * page  # PyTorch's pinned allocator: 8 pages
    with pytest.raises(ValueError):
        mapped_bytes(0)


def test_host_store_cpu_buffers_are_zeroed_writable_and_outlive_their_caller():
    store = HostKVStore("cpu")
    page = mmap.PAGESIZE
    a = store.zeros(3 * page + 10)
    b = store.zeros(7)
    assert (a.dtype, a.shape, a.device.type) == (torch.int8, (3 * page + 10,), "cpu")
    assert b.shape == (7,) and not a.any() and not b.any()
    assert store.mapped_bytes == 5 * page
    a[-1] = 5
    a_ptr = a.data_ptr()
    del a
    gc.collect()
    again = torch.frombuffer(store._regions[0].mapping, dtype=torch.int8)
    assert again.data_ptr() == a_ptr and again[3 * page + 9] == 5
    del again, b
    store.close()
    assert store.mapped_bytes == 0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_host_store_cuda_buffers_are_device_views_of_pinned_host_memory():
    store = HostKVStore("cuda")
    page = mmap.PAGESIZE
    n = 5 * page + 1
    device_bytes = torch.cuda.memory_allocated()
    view = store.zeros(n)
    assert (view.device.type, view.dtype, view.numel()) == ("cuda", torch.int8, n)
    assert torch.cuda.memory_allocated() == device_bytes  # nothing of it is device memory
    host = store._regions[0].host
    assert host.is_pinned() and store.mapped_bytes == 6 * page
    assert int(view.sum()) == 0
    view.fill_(3)  # a kernel writes the host's bytes through UVA
    view[:page].add_(1)
    torch.cuda.synchronize()
    assert (host[:page] == 4).all() and (host[page:n] == 3).all() and (host[n:] == 0).all()
    host[n - 1] = 9  # and reads what the host wrote
    assert int(view[n - 1]) == 9
    del view, host
    store.close()
    assert store.mapped_bytes == 0


def _kv_config(packed: bool):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    page = spec.page_size_bytes
    if packed:  # one backing for both layers, interleaved per block
        tensors = [KVCacheTensor(size=4 * page * 2, shared_by=[layer], offset=i * page,
                                 block_stride=2 * page) for i, layer in enumerate(layers)]  # fmt: skip
    else:
        tensors = [KVCacheTensor(size=4 * page, shared_by=[layer]) for layer in layers]
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)]), layers  # fmt: skip


@pytest.mark.parametrize(
    "packed, device",
    [
        (False, "cpu"),
        (True, "cpu"),
        pytest.param(True, "cuda", marks=[pytest.mark.gpu, needs_cuda]),
    ],
)
def test_v2_runner_allocates_kv_in_the_host_store_only_while_the_hook_is_open(packed, device):
    from vllm.v1.worker.gpu import attn_utils

    config, layers = _kv_config(packed)
    original = attn_utils._allocate_kv_cache
    store = HostKVStore(device)
    with host_kv_allocation(None, v2_runner=True, store=store):
        raw = attn_utils._allocate_kv_cache(config, {}, torch.device(device))
    assert {t.device.type for t in raw.values()} == {device}
    assert attn_utils._allocate_kv_cache is original
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert [raw[layer].numel() for layer in layers] == [t.size for t in config.kv_cache_tensors]
    assert len(store._regions) == (1 if packed else 2)
    assert (raw[layers[0]].data_ptr() == raw[layers[1]].data_ptr()) == packed
    starts = {r.host.data_ptr() for r in store._regions}
    assert {raw[layer].data_ptr() for layer in layers} <= starts
    assert store.mapped_bytes == sum(mapped_bytes(4 * page * (2 if packed else 1))
                                     for _ in range(1 if packed else 2))  # fmt: skip
    del raw
    store.close()


def test_v1_runner_allocates_kv_in_the_host_store_only_while_the_hook_is_open():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class V1Runner:  # the two attributes the V1 allocation reads
        _allocate_kv_cache_tensors = GPUModelRunner._allocate_kv_cache_tensors

        def __init__(self):
            self.device = torch.device("cpu")
            self.runner_only_attn_layers: set[str] = set()

    runner = V1Runner()
    config, layers = _kv_config(packed=False)
    store = HostKVStore("cpu")
    with host_kv_allocation(runner, v2_runner=False, store=store):
        raw = runner._allocate_kv_cache_tensors(config)
        assert runner.device == torch.device("cpu")
    assert "_allocate_kv_cache_tensors" not in vars(runner)
    assert {raw[layer].data_ptr() for layer in layers} == {
        r.host.data_ptr() for r in store._regions
    }
    outside = runner._allocate_kv_cache_tensors(config)
    assert not {t.data_ptr() for t in outside.values()} & {
        r.host.data_ptr() for r in store._regions
    }


# ---------------------------------------------------------------- config time
def _engine_config(tiny_model, hip, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=tiny_model, attention_backend="infinitehip",
                      additional_config={"infinitehip": hip}, max_model_len=4096, **kw)  # fmt: skip
    return args.create_engine_config()


def test_offload_selects_the_host_tier_worker_and_only_then(tiny_model):
    from vllm.platforms import current_platform

    from vllm_infinitehip.compat import HOST_TIER_WORKERS

    on_cpu = current_platform.is_cpu()
    cfg = _engine_config(tiny_model, {"offload": {"host_gib": 1}})
    assert cfg.parallel_config.worker_cls == HOST_TIER_WORKERS["cpu" if on_cpu else "cuda"]
    cfg = _engine_config(tiny_model, {"offload": False})
    assert cfg.parallel_config.worker_cls == (
        "vllm.v1.worker.cpu_worker.CPUWorker" if on_cpu else "vllm.v1.worker.gpu_worker.Worker"
    )


class ExtensionWithOurs(InfiniteHiPWorkerExtension):
    """A user's worker extension that keeps the named methods."""


def test_the_named_worker_methods_are_set_and_a_users_extension_is_kept(tiny_model):
    from vllm_infinitehip.compat import WORKER_EXTENSION

    for hip in ({}, {"offload": {"host_gib": 1}}):
        cfg = _engine_config(tiny_model, hip)
        assert cfg.parallel_config.worker_extension_cls == WORKER_EXTENSION
    theirs = f"{__name__}.ExtensionWithOurs"
    cfg = _engine_config(tiny_model, {}, worker_extension_cls=theirs)
    assert cfg.parallel_config.worker_extension_cls == theirs
    # the tier's worker has the methods as a base: a second copy would conflict in the worker
    with pytest.raises(ValueError, match=r"subclasses .*InfiniteHiPWorkerExtension.*drop"):
        _engine_config(tiny_model, {"offload": {"host_gib": 1}}, worker_extension_cls=theirs)


def test_offload_refuses_a_custom_worker_and_kv_connectors_before_any_engine(tiny_model):
    from vllm.config import KVTransferConfig

    with pytest.raises(ValueError, match=r"`infinitehip\.offload` .*worker_cls='my\.Worker'"):
        _engine_config(tiny_model, {"offload": True}, worker_cls="my.Worker")
    with pytest.raises(ValueError, match=r"`infinitehip\.offload` .*kv_offloading_size=4"):
        _engine_config(tiny_model, {"offload": True}, kv_offloading_size=4)
    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(
        ValueError,
        match=r"`infinitehip\.offload` cannot run with a KV connector "
        r"\(kv_transfer_config\.kv_connector='ExampleConnector'\)",
    ):
        _engine_config(tiny_model, {"offload": True}, kv_transfer_config=connector)


# ---------------------------------------------------------------- engines (CPU)
def _llm(tiny_model, offload, **kw):
    from vllm import LLM

    return LLM(tiny_model, attention_backend="infinitehip",
               additional_config={"infinitehip": {**SMALL_HIP, "offload": offload}},
               **{**ENGINE_KW, **kw})  # fmt: skip


@pytest.mark.vllm
def test_kv_connector_alongside_offload_fails_with_our_message(tiny_model):
    from vllm.config import KVTransferConfig

    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match=r"`infinitehip\.offload` cannot run with a KV connector"):
        _llm(tiny_model, {"host_gib": 0.25}, kv_transfer_config=connector)


@pytest.mark.vllm
def test_host_gib_beyond_the_machine_fails_at_startup_naming_it(tiny_model):
    with pytest.raises(ValueError, match=r"`infinitehip\.offload\.host_gib`=1000000.* available"):
        _llm(tiny_model, {"host_gib": 1_000_000})


@pytest.mark.vllm
def test_cpu_bank_beyond_the_tier_fails_at_startup_naming_it(tiny_model):
    with pytest.raises(ValueError, match=r"`infinitehip\.offload\.bank_gib`=0\.02 .*host_gib"):
        _llm(tiny_model, {"host_gib": 0.01, "bank_gib": 0.02})


def _worker_view(worker) -> dict:
    """Runs in the worker (collective_rpc): the tier, vLLM's KV geometry, the tracked blocks."""
    from vllm_infinitehip.block_manager import tier

    t = tier.current()
    return {
        "worker_cls": type(getattr(worker, "worker", worker)).__name__,
        "host_bytes": t.host_bytes,
        "bank_bytes": t.bank_bytes,
        "released_blocks": t.released_blocks,
        "page_bytes": sum(s.page_size_bytes for s in worker.get_kv_cache_spec().values()),
        "block_size": worker.cache_config.block_size,
        "blocks": {r: list(b) for r, b in worker._block_owners.blocks.items()},
    }


# A page of the tiny model (one 128-token block of both layers, K and V in fp32) is 128 KiB;
# 20 pages hold 2560 tokens: more than max_model_len, less than three 650-token prompts that
# grow by 200 tokens each.
TIER_PAGES = 20
TINY_PAGE_BYTES = 2 * 64 * 1024


def _view(llm) -> dict:
    return llm.collective_rpc(_worker_view)[0]


def _ours(req_id: str) -> str:
    return req_id.split("-")[0]  # vLLM may suffix the ids it was given


def _run(llm, requests: dict[str, tuple[str, int]], abort_after: int | None = None) -> dict:
    """Step ``llm``'s engine until ``requests`` are done and vLLM has told the worker so,
    checking after every step that the worker tracks exactly the blocks vLLM's scheduler gave
    each running request. Returns tokens per request and the blocks the worker last saw each
    one hold."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in-process engine core
    for req_id, (prompt, max_tokens) in requests.items():
        engine.add_request(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens: dict[str, list[int]] = {}
    held: dict[str, list[int]] = {}
    steps = 0
    while scheduler.has_requests():  # until finished and aborted ones are reported too
        for out in engine.step():
            if out.finished:
                tokens[_ours(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
        tracked = {_ours(r): b for r, b in _view(llm)["blocks"].items()}
        held.update({r: b for r, b in tracked.items() if r in requests})
        for req in scheduler.running:
            vllm_blocks = scheduler.kv_cache_manager.get_block_ids(req.request_id)
            assert tracked[_ours(req.request_id)] == [b for group in vllm_blocks for b in group]
        if steps == abort_after:
            engine.abort_request(list(requests))
    return {"tokens": tokens, "held": held}


@pytest.fixture(scope="module")
def offload_llm(tiny_model):
    llm = _llm(tiny_model, {"host_gib": TIER_PAGES * TINY_PAGE_BYTES / GIB},
               max_model_len=2048, disable_log_stats=False)  # fmt: skip
    yield llm
    del llm
    gc.collect()


@pytest.mark.vllm
def test_an_offload_engine_reports_the_host_tier_as_its_kv_capacity(offload_llm):
    view = _view(offload_llm)
    assert view["worker_cls"] == "InfiniteHiPCPUWorker"
    assert view["page_bytes"] == TINY_PAGE_BYTES and view["block_size"] == 128
    assert view["host_bytes"] == TIER_PAGES * TINY_PAGE_BYTES
    assert view["bank_bytes"] == view["host_bytes"] // 8
    # vLLM's block count (scheduler and worker) is the host tier's, in pages
    assert offload_llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == TIER_PAGES


@pytest.mark.vllm
def test_a_finished_request_releases_its_blocks_on_the_next_step(offload_llm):
    before = _view(offload_llm)["released_blocks"]
    prompt = "alpha " * 300
    done = _run(offload_llm, {"fin": (prompt, 10)})
    assert len(done["tokens"]["fin"]) == 10
    computed = len(offload_llm.get_tokenizer().encode(prompt)) + 10 - 1  # the last token: not fed
    assert len(done["held"]["fin"]) == -(-computed // 128)
    after = _view(offload_llm)
    assert after["released_blocks"] - before == len(done["held"]["fin"])
    assert after["blocks"] == {}


@pytest.mark.vllm
def test_an_aborted_request_releases_its_blocks_on_the_next_step(offload_llm):
    before = _view(offload_llm)["released_blocks"]
    aborted = _run(offload_llm, {"abort": ("delta " * 400, 200)}, abort_after=4)
    assert "abort" not in aborted["tokens"] and len(aborted["held"]["abort"]) >= 4
    after = _view(offload_llm)
    assert after["released_blocks"] - before == len(aborted["held"]["abort"])
    assert after["blocks"] == {}


@pytest.mark.vllm
def test_preempted_requests_release_and_reacquire_blocks_as_vllm_says(offload_llm):
    """Three requests outgrow the tier; vLLM preempts one and recomputes it later. The worker
    follows (checked against the scheduler every step) and, once all are done, has released
    every block any of them held."""
    before = _view(offload_llm)["released_blocks"]
    prompts = {f"pre{i}": (f"{tag} " + "word " * 640, 200)
               for i, tag in enumerate(("epsilon", "zeta", "eta"))}  # fmt: skip
    crowd = _run(offload_llm, prompts)
    assert [len(crowd["tokens"][r]) for r in prompts] == [200, 200, 200]
    metrics = offload_llm.get_metrics()
    assert sum(m.value for m in metrics if m.name == "vllm:num_preemptions") > 0
    after = _view(offload_llm)
    assert after["blocks"] == {}
    ever_held = {b for r in prompts for b in crowd["held"][r]}
    assert after["released_blocks"] - before >= len(ever_held) > TIER_PAGES // 2


def test_key_row_metrics_add_over_ranks_and_reach_the_wire_only_when_a_bank_has_them():
    from vllm_infinitehip.prometheus import summarize_gauges

    ranks = {"0": {"live_slots": 2, "tier_resident_pages": 3, "tier_bank_slots": 10,
                   "tier_key_rows_resident": 5, "tier_key_row_slots": 40},
             "1": {"live_slots": 2, "tier_resident_pages": 4, "tier_bank_slots": 10,
                   "tier_key_rows_resident": 7, "tier_key_row_slots": 40}}  # fmt: skip
    assert summarize_gauges(ranks) == {"live_slots": 2, "tier_resident_pages": 7,
                                       "tier_bank_slots": 20, "tier_key_rows_resident": 12,
                                       "tier_key_row_slots": 80}  # fmt: skip
    cpu = {"0": {"live_slots": 0, "tier_resident_pages": 0, "tier_bank_slots": 10}}
    assert "tier_key_row_slots" not in summarize_gauges(cpu)
