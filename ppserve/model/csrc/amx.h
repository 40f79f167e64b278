/* Intel AMX tile set-up shared by the AMX kernels. Defines HAVE_AMX where the compiler targets AMX-BF16
 * (-march=native on such a CPU). Every kernel uses the same palette: 8 tiles of 16 rows x 64 bytes. */
#ifndef PPSERVE_AMX_H
#define PPSERVE_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tile state is per thread: each OpenMP thread configures before its first tile instruction (and
 * oneDNN reconfigures before its own). */
static inline void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#endif
#endif /* PPSERVE_AMX_H */
