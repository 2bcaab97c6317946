"""The GPU path of the host tier (run on the device: scripts/gpu_check.sh): pages written to pinned
host memory on the copy stream and loaded back into other device pages arrive bit for bit, and the
compute stream's next work sees the loaded pages without a host wait."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory.host_tier import HostKvTier, StreamCopies
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_pages_round_trip_through_pinned_memory_on_the_copy_stream(layout):
    device = torch.device("cuda")
    spec = KVPoolSpec.of(dtype="bfloat16", page_size=16, layout=layout, device=device, mode="static")
    pool = MHAKVPool(spec, reserved_tokens=1024, num_layers=4, num_kv_heads=8, head_dim=128)
    views = pool.page_views()
    for view in views:
        view.copy_(torch.randint(0, 255, view.shape, dtype=torch.uint8, device=device))
    tier = HostKvTier(views, num_pages=32, page_size=16, copies=StreamCopies(device), pin_memory=True)
    source = torch.tensor([3, 4, 5, 9, 12, 13])
    host = tier.alloc(source.numel())
    assert host is not None
    expected = [view[source.to(device)].clone() for view in views]
    tier.write(source, host).wait()
    target = torch.tensor([40, 41, 42, 50, 51, 60])
    tier.load(host, target)  # the compute stream's next work waits for it; the host does not
    loaded = [view[target.to(device)] for view in views]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(loaded, expected))
    traffic = tier.traffic()
    assert traffic.bytes_to_device == traffic.bytes_to_host == 6 * tier.page_bytes
    tier.close()
    pool.close()
