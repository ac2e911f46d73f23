// Registers memory through the real libibverbs on the first RDMA device,
// for bpf's TestRealVerbsExactCounts (run where a device exists, e.g. the
// rxe qemu guest). Prints "nodevice" and exits 0 when there is none.
// Otherwise prints "ready", waits for a line on stdin, then makes N
// ibv_reg_mr + ibv_dereg_mr pairs of SIZE bytes and prints "done".
// With N = 0 it stops after "ready": a check that a device is usable.
//   cc -O1 -o ibvreg ibvreg.c -libverbs
//   ibvreg N SIZE
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	int n = atoi(argv[1]);
	size_t size = strtoul(argv[2], 0, 10);
	int num = 0;
	struct ibv_device **devs = ibv_get_device_list(&num);
	if (!devs || num == 0) {
		printf("nodevice\n");
		return 0;
	}
	struct ibv_context *ctx = ibv_open_device(devs[0]);
	if (!ctx) {
		perror("ibv_open_device");
		return 1;
	}
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd) {
		perror("ibv_alloc_pd");
		return 1;
	}
	char *buf = malloc(size);
	if (!buf)
		return 1;
	char line[16];
	printf("ready\n");
	fflush(stdout);
	if (n == 0) // only asked whether a device is usable
		return 0;
	if (!fgets(line, sizeof(line), stdin))
		return 1;
	for (int i = 0; i < n; i++) {
		struct ibv_mr *mr = ibv_reg_mr(pd, buf, size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		if (!mr) {
			perror("ibv_reg_mr");
			return 1;
		}
		if (ibv_dereg_mr(mr)) {
			perror("ibv_dereg_mr");
			return 1;
		}
	}
	printf("done\n");
	fflush(stdout);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(devs);
	return 0;
}
