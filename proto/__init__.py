"""Proto room: the `.proto` files that are the contracts between services, and the gRPC stubs
generated from them (regenerate, never hand-edit). Filled by a later issue.
"""
