//go:build ignore

// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// Probes for memory registration (libibverbs and rdmagrpc's shm provider)
// and for rdmagrpc's buffer-enlargement marker. Built by bpf2go (see
// gen.go); the generated .o is committed so building needs no clang.
//
// Two probe shapes:
//   C functions (libibverbs):  uprobe at entry + uretprobe, keyed by thread.
//   Go functions (rdmagrpc):   uprobe at entry + uprobe on every RET
//                              instruction, keyed by goroutine (R14). A
//                              uretprobe would rewrite the return address on
//                              the goroutine stack, which Go's stack copying
//                              and unwinder do not expect: the target crashes.
//
// The attach cookie carries (probe id << 8 | kind): kind selects what the
// program reads, the probe id lets user space name the function.

#include <linux/bpf.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name

typedef __u64 u64;
typedef __u32 u32;
typedef __u8 u8;

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// Helpers are called through their fixed ids from linux/bpf.h.
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value, u64 flags) = (void *)BPF_FUNC_map_update_elem;
static long (*bpf_map_delete_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_delete_elem;
static u64 (*bpf_ktime_get_ns)(void) = (void *)BPF_FUNC_ktime_get_ns;
static u64 (*bpf_get_current_pid_tgid)(void) = (void *)BPF_FUNC_get_current_pid_tgid;
static long (*bpf_get_current_comm)(void *buf, u32 size) = (void *)BPF_FUNC_get_current_comm;
static long (*bpf_probe_read_user)(void *dst, u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user;
static void *(*bpf_ringbuf_reserve)(void *ringbuf, u64 size, u64 flags) = (void *)BPF_FUNC_ringbuf_reserve;
static void (*bpf_ringbuf_submit)(void *data, u64 flags) = (void *)BPF_FUNC_ringbuf_submit;
static u64 (*bpf_get_attach_cookie)(void *ctx) = (void *)BPF_FUNC_get_attach_cookie;
static u64 (*bpf_ringbuf_query)(void *ringbuf, u64 flags) = (void *)BPF_FUNC_ringbuf_query;

// Waking the reader costs a context switch per event, more than the probe
// itself on a busy machine. Submit quietly until this much is pending; the
// reader also polls on a short interval, so a trickle is not delayed long.
#define WAKEUP_BYTES (64 * 1024)

// The x86-64 register frame a uprobe program receives (struct pt_regs).
struct regs {
	u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	u64 ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};

// Kinds, in the low byte of the attach cookie. Keep in sync with kind.go.
enum {
	KIND_IBV_REG_MR = 1,     // ibv_reg_mr_iova2(pd, addr, length, iova, access) -> mr
	KIND_IBV_REG_DMABUF = 2, // ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access) -> mr
	KIND_IBV_REREG_MR = 3,   // ibv_rereg_mr(mr, flags, pd, addr, length, access) -> int
	KIND_IBV_DEREG_MR = 4,   // ibv_dereg_mr(mr) -> int
	KIND_GO_FUNC = 5,        // any Go ABIInternal function; user space decodes
};

#define MAX_ARGS 9
#define MAX_RETS 9

// Start of struct ibv_mr: context, pd, addr, length, handle, lkey, rkey.
struct ibv_mr_head {
	u64 context, pd, addr, length;
	u32 handle, lkey, rkey;
};

struct call_key {
	u64 id;    // thread id (C) or goroutine pointer (Go)
	u32 tgid;  // goroutine pointers are only unique within a process
	u32 probe; // one pending call per probed function, so nesting cannot clobber
};

struct call {
	u64 start_ns;
	u64 args[MAX_ARGS];
	u64 mr_addr, mr_len; // region named by an mr argument, read at entry
	u32 entry_tid;       // differs from the returning thread when a goroutine moved
	u32 pad;
};

struct event {
	u64 start_ns;
	u64 duration_ns;
	u64 cookie;
	u64 args[MAX_ARGS];
	u64 rets[MAX_RETS];
	u64 mr_addr, mr_len;
	u32 mr_lkey, mr_rkey;
	u32 pid, tid;
	u32 entry_tid, pad;
	u8 comm[16];
};

// Counters user space reports so lost data is never silent.
enum {
	STAT_EVENTS = 0,     // events submitted
	STAT_RINGBUF_FULL,   // events lost: ring buffer full
	STAT_NO_ENTRY,       // a return without a recorded entry (attached mid-call)
	STAT_ENTRY_FULL,     // an entry not recorded: pending-call map full
	STAT_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct call_key);
	__type(value, struct call);
} calls SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_MAX);
	__type(key, u32);
	__type(value, u64);
} stats SEC(".maps");

// Forces BTF for struct event so bpf2go emits its Go twin.
const struct event *unused_event __attribute__((unused));

static __always_inline void count(u32 which)
{
	u64 *v = bpf_map_lookup_elem(&stats, &which);
	if (v)
		*v += 1;
}

static __always_inline void read_mr(u64 mr, u64 *addr, u64 *len, u32 *lkey, u32 *rkey)
{
	struct ibv_mr_head h = {};
	if (!mr || bpf_probe_read_user(&h, sizeof(h), (const void *)mr) != 0)
		return;
	*addr = h.addr;
	*len = h.length;
	if (lkey)
		*lkey = h.lkey;
	if (rkey)
		*rkey = h.rkey;
}

static __always_inline int enter(struct regs *ctx, u64 id, int go)
{
	u64 cookie = bpf_get_attach_cookie(ctx);
	struct call_key key = {
		.id = id,
		.tgid = bpf_get_current_pid_tgid() >> 32,
		.probe = cookie >> 8,
	};
	struct call c = {};

	c.start_ns = bpf_ktime_get_ns();
	c.entry_tid = (u32)bpf_get_current_pid_tgid();
	if (go) {
		// Go ABIInternal integer argument registers, in order.
		c.args[0] = ctx->ax; c.args[1] = ctx->bx; c.args[2] = ctx->cx;
		c.args[3] = ctx->di; c.args[4] = ctx->si; c.args[5] = ctx->r8;
		c.args[6] = ctx->r9; c.args[7] = ctx->r10; c.args[8] = ctx->r11;
	} else {
		// System V AMD64 integer argument registers, in order.
		c.args[0] = ctx->di; c.args[1] = ctx->si; c.args[2] = ctx->dx;
		c.args[3] = ctx->cx; c.args[4] = ctx->r8; c.args[5] = ctx->r9;
		u32 kind = cookie & 0xff;
		if (kind == KIND_IBV_REREG_MR || kind == KIND_IBV_DEREG_MR)
			read_mr(c.args[0], &c.mr_addr, &c.mr_len, 0, 0);
	}
	if (bpf_map_update_elem(&calls, &key, &c, BPF_ANY) != 0)
		count(STAT_ENTRY_FULL);
	return 0;
}

static __always_inline int leave(struct regs *ctx, u64 id, int go)
{
	u64 now = bpf_ktime_get_ns();
	u64 cookie = bpf_get_attach_cookie(ctx);
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct call_key key = {
		.id = id,
		.tgid = pid_tgid >> 32,
		.probe = cookie >> 8,
	};
	struct call *c = bpf_map_lookup_elem(&calls, &key);
	if (!c) {
		count(STAT_NO_ENTRY);
		return 0;
	}
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count(STAT_RINGBUF_FULL);
		bpf_map_delete_elem(&calls, &key);
		return 0;
	}
	e->start_ns = c->start_ns;
	e->duration_ns = now - c->start_ns;
	e->cookie = cookie;
#pragma unroll
	for (int i = 0; i < MAX_ARGS; i++)
		e->args[i] = c->args[i];
	e->mr_addr = c->mr_addr;
	e->mr_len = c->mr_len;
	e->mr_lkey = 0;
	e->mr_rkey = 0;
	e->rets[0] = ctx->ax;
	if (go) {
		// Go ABIInternal integer result registers, in order.
		e->rets[1] = ctx->bx; e->rets[2] = ctx->cx; e->rets[3] = ctx->di;
		e->rets[4] = ctx->si; e->rets[5] = ctx->r8; e->rets[6] = ctx->r9;
		e->rets[7] = ctx->r10; e->rets[8] = ctx->r11;
	} else {
#pragma unroll
		for (int i = 1; i < MAX_RETS; i++)
			e->rets[i] = 0;
		u32 kind = cookie & 0xff;
		// A registration returns the new struct ibv_mr: read what it names.
		if (kind == KIND_IBV_REG_MR || kind == KIND_IBV_REG_DMABUF)
			read_mr(ctx->ax, &e->mr_addr, &e->mr_len, &e->mr_lkey, &e->mr_rkey);
	}
	e->entry_tid = c->entry_tid;
	e->pad = 0;
	e->pid = pid_tgid >> 32;
	e->tid = (u32)pid_tgid;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	u64 flags = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= WAKEUP_BYTES ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
	bpf_ringbuf_submit(e, flags);
	bpf_map_delete_elem(&calls, &key);
	count(STAT_EVENTS);
	return 0;
}

SEC("uprobe/lib_entry")
int lib_entry(struct regs *ctx)
{
	return enter(ctx, bpf_get_current_pid_tgid(), 0);
}

SEC("uretprobe/lib_return")
int lib_return(struct regs *ctx)
{
	return leave(ctx, bpf_get_current_pid_tgid(), 0);
}

SEC("uprobe/go_entry")
int go_entry(struct regs *ctx)
{
	return enter(ctx, ctx->r14, 1);
}

SEC("uprobe/go_return")
int go_return(struct regs *ctx)
{
	return leave(ctx, ctx->r14, 1);
}
