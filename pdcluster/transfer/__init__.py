"""KV connector room: scheduler-side planning and worker-side execution of KV block transfers,
the single Mooncake TransferEngine wrapper, the ZMQ+msgpack side channel and a loopback fake.
May import only `core`. The worker is `transfer.connector_worker`, the scheduler side
`transfer.connector_scheduler`; see docs/transfer.md.
"""
