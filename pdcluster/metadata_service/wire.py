"""gRPC settings shared by the metadata server and its client library, kept here so the
client never imports the server."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
AUTH_HEADER = "authorization"
