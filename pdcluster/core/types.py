"""Id aliases shared by every room. Plain aliases: they document intent at zero cost. The caps
are the most characters any id (request, transfer, node) or address may have wherever a peer
can choose it: on the wire (core.wire caps each field), in the metadata service's registry."""

ReqId = str
NodeId = str
TokenId = int
BlockId = int
# A block hash is the digest of a chained hash (see core.hashing): 32 bytes for SHA-256,
# 16 bytes for xxh3-128. Bytes compare, hash and pack into msgpack without conversion.
BlockHash = bytes

MAX_ID_CHARS = 256
MAX_ADDRESS_CHARS = 256
