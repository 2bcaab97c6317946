"""Several engines sharing one device (`snugkv serve --kv-elastic`): the one home of it.

    record    the per-device JSON record every engine publishes its entry in (locked, no server)
    policy    pure: the pool, each engine's target, when to move (hysteresis, urgency), the wake's ask
    estimate  what a starting engine asks for before it loads (weights, activations, a minimum KV)
    share     MemoryShare: this engine's side (ask, start, the rebalancing turn, leave, wake's hold)
    wake      the ask a sleeping engine makes before it wakes (the engine thread's wake gate)

It acts on its own engine only, through the engine client (core.engine_client) once it serves;
the server shows the record (GET /kv/engines), `snugkv serve` wires it, `snugkv memory --gpu`
prints it. Measuring memory stays in sizing.measure.
"""
