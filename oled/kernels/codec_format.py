"""The encoded rows' header (oled.model.codec): its tags and byte offsets, one description for
the torch encoder and reference decoders there and the GPU decoders (oled.kernels.codec).

Kept apart from both (no triton here), so that the model layer and the kernels below it read
the same numbers.
"""

CHUNK = 1024  # weights per independently decoded chunk
HEADER = 64  # bytes; 16 int32 words
LOSSLESS, FP8, INT4 = 1, 2, 3  # the header's tag
# header words: 0 tag, 1 n (weights), then per codec
# lossless: 2 primary offset, 3 chunk-table offset, 4 secondary offset, 5 escape offset,
#           6 weights per chunk, bytes 32..34 the primary exponents, bytes 36..42 the secondary exponents
# fp8:      2 columns per channel, 3 scales offset, 4 data offset
# int4:     2 weights per scale (the group), 3 scales offset, 4 codes offset
PRIMARY_BOOK, SECONDARY_BOOK = 32, 36
