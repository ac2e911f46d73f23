// Calls the fake libibverbs a scripted number of times once a line
// arrives on stdin: argv = n (reg+dereg pairs), fail, dmabuf, rereg, compat.
// "driver bench N" instead times N reg+dereg pairs and prints ns per pair.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct ibv_mr;
struct ibv_mr *ibv_reg_mr_iova2(void *pd, void *addr, size_t length, uint64_t iova, unsigned int access);
struct ibv_mr *ibv_reg_dmabuf_mr(void *pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access);
int ibv_rereg_mr(struct ibv_mr *mr, int flags, void *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
int compat_dereg(struct ibv_mr *mr);
__asm__(".symver compat_dereg, ibv_dereg_mr@IBVERBS_1.0");

static char buf[1 << 16];

static int bench(long n)
{
	struct timespec a, b;
	char line[16];
	printf("ready\n");
	fflush(stdout);
	if (!fgets(line, sizeof(line), stdin))
		return 1;
	clock_gettime(CLOCK_MONOTONIC, &a);
	for (long i = 0; i < n; i++)
		ibv_dereg_mr(ibv_reg_mr_iova2(0, buf, 4096, (uintptr_t)buf, 7));
	clock_gettime(CLOCK_MONOTONIC, &b);
	double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
	printf("%.1f\n", ns / n);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 3 && strcmp(argv[1], "bench") == 0)
		return bench(atol(argv[2]));
	if (argc != 6)
		return 2;
	int n = atoi(argv[1]), fail = atoi(argv[2]), dmabuf = atoi(argv[3]), rereg = atoi(argv[4]), compat = atoi(argv[5]);
	char line[16];
	printf("ready\n");
	fflush(stdout);
	if (!fgets(line, sizeof(line), stdin))
		return 1;
	for (int i = 0; i < n; i++) {
		struct ibv_mr *mr = ibv_reg_mr_iova2(0, buf, 4096, (uintptr_t)buf, 7);
		if (i < rereg)
			ibv_rereg_mr(mr, 1, 0, buf, 8192, 7);
		ibv_dereg_mr(mr);
	}
	for (int i = 0; i < fail; i++)
		ibv_reg_mr_iova2(0, buf, 0, 0, 7);
	for (int i = 0; i < dmabuf; i++)
		ibv_dereg_mr(ibv_reg_dmabuf_mr(0, 0, 2048, 0x1000, 3, 1));
	for (int i = 0; i < compat; i++)
		compat_dereg(0);
	printf("done\n");
	fflush(stdout);
	return 0;
}
