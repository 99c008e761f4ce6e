"""KV connector room: scheduler-side planning and worker-side execution of KV block transfers,
the single Mooncake TransferEngine wrapper, the ZMQ+msgpack side channel and a loopback fake.
May import only `core`. Filled by a later issue.
"""
