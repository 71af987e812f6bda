/* Paged attention's work-item bodies at head_dim 128 and 256 (csrc/paged_attention_items.h): a translation unit of their own,
 * compiled beside csrc/paged_attention.c. */
#include "paged_attention_items.h"

SPECIALISE(1, 128) SPECIALISE(2, 128) SPECIALISE(3, 128) SPECIALISE(4, 128)
SPECIALISE(5, 128) SPECIALISE(6, 128) SPECIALISE(7, 128) SPECIALISE(8, 128)
SPECIALISE(1, 256) SPECIALISE(2, 256) SPECIALISE(4, 256)
