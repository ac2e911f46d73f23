// A stand-in for libibverbs with the same registration signatures and the
// same symbol versioning trick (a compat ibv_dereg_mr@IBVERBS_1.0 beside
// the default ibv_dereg_mr@@IBVERBS_1.1), so tests can count calls exactly
// on a host without an RDMA device.
#include <stdint.h>
#include <stdlib.h>

struct ibv_mr {
	void *context, *pd, *addr;
	size_t length;
	uint32_t handle, lkey, rkey;
};

static uint32_t next_key = 100;

// Both registration entry points share this, without a call through the
// PLT, as in libibverbs: one call, one event.
static struct ibv_mr *reg(size_t length, void *addr)
{
	if (length == 0)
		return NULL;
	struct ibv_mr *mr = calloc(1, sizeof(*mr));
	mr->addr = addr;
	mr->length = length;
	mr->lkey = next_key++;
	mr->rkey = next_key++;
	return mr;
}

struct ibv_mr *ibv_reg_mr_iova2(void *pd, void *addr, size_t length, uint64_t iova, unsigned int access)
{
	(void)pd; (void)iova; (void)access;
	return reg(length, addr);
}

struct ibv_mr *ibv_reg_dmabuf_mr(void *pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access)
{
	(void)pd; (void)offset; (void)fd; (void)access;
	return reg(length, (void *)(uintptr_t)iova);
}

int ibv_rereg_mr(struct ibv_mr *mr, int flags, void *pd, void *addr, size_t length, int access)
{
	(void)pd; (void)access;
	if (flags & 1) {
		mr->addr = addr;
		mr->length = length;
	}
	return 0;
}

int dereg_default(struct ibv_mr *mr)
{
	free(mr);
	return 0;
}

int dereg_compat(struct ibv_mr *mr)
{
	(void)mr;
	return 0;
}

__asm__(".symver dereg_default, ibv_dereg_mr@@IBVERBS_1.1");
__asm__(".symver dereg_compat, ibv_dereg_mr@IBVERBS_1.0");
