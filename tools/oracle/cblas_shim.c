/* Route MLX's CPU GEMMs to OpenBLAS (speed only; no effect on what is computed beyond summation order).
 *
 * The Linux mlx-cpu wheel links the Netlib *reference* BLAS (a plain triple loop, ~0.5 GFLOP/s
 * here), and MLX's CPU matmul calls cblas_sgemm from it. scipy-openblas32 (a PyPI wheel) ships an
 * optimised OpenBLAS whose symbols carry a `scipy_` prefix. This shim exports the three unprefixed
 * names libmlx imports (cblas_sgemm, cblas_dgemm, cblas_cgemm) and forwards them. oracle.py loads
 * it with RTLD_GLOBAL before importing mlx.core, so libmlx binds to it instead of the bundled
 * reference BLAS. Built by scripts/oracle-setup into the oracle venv; absent, the oracle still
 * works, only slower.
 */

typedef int blasint; /* scipy-openblas32: 32-bit integers (LP64) */

void scipy_cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, float alpha,
                       const float *a, blasint lda, const float *b, blasint ldb, float beta,
                       float *c, blasint ldc);
void scipy_cblas_dgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, double alpha,
                       const double *a, blasint lda, const double *b, blasint ldb, double beta,
                       double *c, blasint ldc);
void scipy_cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                       const void *alpha, const void *a, blasint lda, const void *b, blasint ldb,
                       const void *beta, void *c, blasint ldc);

void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, float alpha,
                 const float *a, blasint lda, const float *b, blasint ldb, float beta, float *c,
                 blasint ldc) {
    scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, double alpha,
                 const double *a, blasint lda, const double *b, blasint ldb, double beta,
                 double *c, blasint ldc) {
    scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, const void *alpha,
                 const void *a, blasint lda, const void *b, blasint ldb, const void *beta,
                 void *c, blasint ldc) {
    scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* A marker oracle.py checks to confirm the shim (not the reference BLAS) is bound. */
int lily_cblas_shim_version(void) { return 1; }
