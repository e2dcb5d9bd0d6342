/* The vector instruction sets this build uses, from the compiler's feature macros: the machine's
   own (-march=native), capped by GRAPHSERVE_CPU_ISA (engine/cpu/build.py). GS_GENERIC (the
   `generic` cap) takes none: the plain C paths, which every CPU runs.

   x86: GS_AVX512 (F, BW, VL, DQ), GS_AVX512_VNNI, GS_AVX2 (with FMA and F16C), GS_AVX_VNNI (the
   256-bit vpdpbusd of CPUs without AVX-512). A build with GS_AVX512 also has GS_AVX2.
   ARM: GS_NEON (every AArch64 CPU), GS_DOTPROD (sdot), GS_I8MM (smmla). */
#ifndef GS_ISA_H
#define GS_ISA_H

#if !defined(GS_GENERIC)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GS_AVX2 1
#if defined(__AVXVNNI__)
#define GS_AVX_VNNI 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GS_AVX512 1
#if defined(__AVX512VNNI__)
#define GS_AVX512_VNNI 1
#endif
#endif
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define GS_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define GS_DOTPROD 1
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define GS_I8MM 1
#endif
#endif
#endif

/* the name a library's gs_isa() reports for its vector paths (the engine logs it at start) */
#if defined(GS_AVX512)
#define GS_ISA_NAME "AVX-512"
#elif defined(GS_AVX2)
#define GS_ISA_NAME "AVX2"
#elif defined(GS_NEON)
#define GS_ISA_NAME "NEON"
#else
#define GS_ISA_NAME "generic"
#endif

#if defined(GS_AVX2)
#include <immintrin.h>
#endif
#if defined(GS_NEON)
#include <arm_neon.h>
#endif

#endif
