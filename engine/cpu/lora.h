/* One projection's LoRA adapter slots as lora.c's lora_add reads them (engine/cpu/lora.py builds it;
   decoder.c holds one per projection of each layer). The layouts are engine/lora/apply.py's. */
#ifndef GS_LORA_H
#define GS_LORA_H

#include <stdint.h>

#define GS_LORA_MAX_SLICES 4

struct lora_projection {
    const float* a;          /* slot s: a + s * a_s0, [slices, rank_dim, in] contiguous */
    const float* b;          /* slot s: b + s * b_s0, [out, rank_dim] contiguous */
    int64_t a_s0, b_s0;      /* floats between slots */
    const int32_t* ranks;    /* [slots, slices]: the adapter's rank on each slice (0: it leaves the slice alone) */
    const float* scales;     /* [slots]: its scaling */
    int64_t slots, slices, rank_dim, in;
    int64_t slice_size[GS_LORA_MAX_SLICES];  /* the output's slices, side by side */
};

/* y[row, :] += (B[s] @ (A[s] @ x[row, :])) * scale[s] for each row whose slot s = slots[row] is >= 0 */
typedef void (*lora_add_fn)(const struct lora_projection* p, const int32_t* slots, int64_t rows, const float* x,
                            int64_t ldx, float* y, int64_t ldy);

#endif
