"""KV memory: virtual address space, physical backing, KV pools and slot allocators.

The engine maps a request to its KV data in two steps:

    request --(ReqToTokenPool: req_to_token[req, pos])--> slot --(KV pool buffers)--> K/V bytes

Pools and allocators are separate so that sizing can change one without touching the other:
a pool owns *where* KV lives (buffers laid out in one reserved virtual range, backed by
physical memory only as far as the final token count needs); an allocator owns *which* slots
are in use. Post-capture sizing first lays the pools out as virtual addresses only, captures
CUDA graphs against those fixed addresses, then backs exactly what fits and resizes the
allocators.

Modules, in data-flow order:
    vmm        the VirtualMemory interface, errors, backend choice
    vmm_host   Linux mmap backend (CPU; CI runs the whole pipeline on it)
    vmm_cuda   CUDA driver VMM backend
    views      zero-copy torch tensors over raw addresses (DLPack)
    layout     BufferLayout: the one place that turns tokens into bytes
    arena      one reserved range, named buffers, commit watermarks
    kv_pool    MHA pool; mla_pool, swa_pool for the other attention kinds
    allocator, req_to_token, swa_allocator   slot bookkeeping
    moves      the page moves that let a cache shrink under live requests
    host_tier  the prefix cache's second tier: host pages and the copies to and from the device
    weight_arena   model weights in virtual memory (released and taken back at the same addresses)
"""
