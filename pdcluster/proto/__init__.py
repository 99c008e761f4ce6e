"""Proto room: the `.proto` files that are the contracts between services, and the gRPC stubs
generated from them at setup by scripts/gen_proto.py (git-ignored; regenerate, never
hand-edit). `metadata.proto`: the metadata service (see docs/metadata_service.md).
"""
