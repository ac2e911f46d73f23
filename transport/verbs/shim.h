// Small C wrappers around libibverbs and librdmacm: every call goes
// through the function table load.c fills at run time (abi.h), and the
// parts cgo cannot call directly (static inline verbs, unions,
// pointer-laden event structs) are flattened. Every structure crossing the Go/C boundary here is flat and
// holds no pointers, so Go may pass its own memory (cgo pointer rules).
#ifndef RDMAGRPC_VERBS_SHIM_H
#define RDMAGRPC_VERBS_SHIM_H

#include <stddef.h>
#include <errno.h>
#include <stdint.h>
#include "abi.h"

// shim_wc has the memory layout of transport.WorkCompletion; cq.go checks
// the offsets at compile time so ibv_poll_cq results land in the caller's
// slice without a copy or an allocation.
struct shim_wc {
	uint64_t id;
	uint8_t status;
	uint8_t opcode; // transport.WCOpcode, not enum ibv_wc_opcode
	uint32_t byte_len;
	uint32_t imm; // host order
	uint8_t has_imm;
	uint32_t qp_num;
	uint32_t vendor_err;
};

enum {
	SHIM_WC_SIZE = sizeof(struct shim_wc),
	SHIM_WC_OFF_STATUS = offsetof(struct shim_wc, status),
	SHIM_WC_OFF_OPCODE = offsetof(struct shim_wc, opcode),
	SHIM_WC_OFF_BYTE_LEN = offsetof(struct shim_wc, byte_len),
	SHIM_WC_OFF_IMM = offsetof(struct shim_wc, imm),
	SHIM_WC_OFF_HAS_IMM = offsetof(struct shim_wc, has_imm),
	SHIM_WC_OFF_QP_NUM = offsetof(struct shim_wc, qp_num),
	SHIM_WC_OFF_VENDOR_ERR = offsetof(struct shim_wc, vendor_err),
};

// Opcodes of shim_send (transport.Opcode numbering).
enum {
	SHIM_OP_SEND = 0,
	SHIM_OP_SEND_IMM = 1,
	SHIM_OP_WRITE = 2,
	SHIM_OP_WRITE_IMM = 3,
	SHIM_OP_READ = 4,
};

enum {
	SHIM_F_SIGNALED = 1,
	SHIM_F_INLINE = 2,
};

// shim_send is one send work request; its SGEs are nsge consecutive
// entries of the flat SGE array passed beside it.
struct shim_send {
	uint64_t wr_id;
	uint64_t remote_addr;
	uint32_t rkey;
	uint32_t imm; // host order
	uint32_t nsge;
	uint8_t opcode;
	uint8_t flags;
};

struct shim_recv {
	uint64_t wr_id;
	uint32_t nsge;
};

// Work requests are chained on the C stack in batches of this size.
#define SHIM_POST_BATCH 32

int shim_post_send(struct ibv_qp *qp, const struct shim_send *wrs, int n,
		   const struct ibv_sge *sges, int *posted);
int shim_post_recv(struct ibv_qp *qp, const struct shim_recv *wrs, int n,
		   const struct ibv_sge *sges, int *posted);
// A shared receive queue serves one QP here: its receive queue, resized
// as the QP's depth grows (qp.go, srq.go).
int shim_post_srq_recv(struct ibv_srq *srq, const struct shim_recv *wrs, int n,
		       const struct ibv_sge *sges, int *posted);
// shim_arm_srq asks for IBV_EVENT_SRQ_LIMIT_REACHED once fewer than limit
// receives are left: 0 or an errno.
int shim_arm_srq(struct ibv_srq *srq, uint32_t limit);
struct ibv_srq *shim_create_srq(struct ibv_pd *pd, uint64_t handle, uint32_t max_wr, uint32_t max_sge,
				uint32_t *granted_wr, uint32_t *granted_sge);
// ibv_modify_srq of max_wr: 0 or an errno.
int shim_resize_srq(struct ibv_srq *srq, uint32_t max_wr);
int shim_destroy_srq(struct ibv_srq *srq);
int shim_poll_cq(struct ibv_cq *cq, struct shim_wc *out, int n);
int shim_req_notify_cq(struct ibv_cq *cq);
// ibv_get_cq_event that also returns the CQ and its context (our handle).
int shim_get_cq_event_of(struct ibv_comp_channel *ch, struct ibv_cq **cq, uint64_t *handle);
void shim_ack_cq_events(struct ibv_cq *cq, unsigned int n);

struct shim_port {
	int state;
	int link_layer;
	int active_mtu;
	int gid_tbl_len;
};
int shim_query_port(struct ibv_context *ctx, uint8_t port, struct shim_port *out);

// shim_event is an rdma_cm event copied out of librdmacm's allocation
// (the event is acknowledged before shim_get_cm_event returns, so
// rdma_destroy_id never waits on us).
struct shim_event {
	uint64_t handle;        // context of the id the event is for
	uint64_t listen_handle; // context of the listening id (CONNECT_REQUEST)
	struct rdma_cm_id *id;  // the new id on CONNECT_REQUEST
	int32_t event;
	int32_t status;
	uint32_t private_len;
	uint8_t private_data[256];
};
int shim_get_cm_event(struct rdma_event_channel *ch, struct shim_event *out);

int shim_create_id(struct rdma_event_channel *ch, struct rdma_cm_id **id, uint64_t handle);
void shim_set_id_handle(struct rdma_cm_id *id, uint64_t handle);
struct ibv_context *shim_id_verbs(struct rdma_cm_id *id);

// Addresses travel as (family, 16 address bytes, port in host order).
struct shim_addr {
	int32_t family; // AF_INET, AF_INET6 or 0
	uint16_t port;
	uint8_t ip[16];
	uint32_t scope_id; // IPv6: the interface of a link-local address
};
void shim_local_addr(struct rdma_cm_id *id, struct shim_addr *out);
void shim_peer_addr(struct rdma_cm_id *id, struct shim_addr *out);
int shim_bind_listen(struct rdma_cm_id *id, const struct shim_addr *a, int backlog);
int shim_resolve_addr(struct rdma_cm_id *id, const struct shim_addr *dst, int timeout_ms);
// The verbs context rdma_cm's address resolution picks for dst (NULL and
// *err set on failure): a synchronous throwaway id, no event channel.
struct ibv_context *shim_route_verbs(const struct shim_addr *dst, int timeout_ms, int *err);

// QP attributes chosen by the caller; the rest comes from rdma_init_qp_attr.
struct shim_qp_cfg {
	uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline;
	uint8_t timeout, retry_cnt, rnr_retry, min_rnr_timer;
	// At RTR, when not -1: the address vector's service level and
	// source GID index instead of rdma_cm's.
	int16_t sl, sgid_index;
};
// With srq, the QP receives through it and cfg's receive capacities are
// not used (actual keeps them).
struct ibv_qp *shim_create_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
			      struct ibv_srq *srq, const struct shim_qp_cfg *cfg,
			      struct shim_qp_cfg *actual);
// shim_qp_to moves qp to state using rdma_init_qp_attr(id) plus cfg's overrides.
int shim_qp_to(struct rdma_cm_id *id, struct ibv_qp *qp, int state, const struct shim_qp_cfg *cfg);
int shim_qp_set_state(struct ibv_qp *qp, int state);
int shim_qp_state(struct ibv_qp *qp);

int shim_connect(struct rdma_cm_id *id, uint32_t qp_num, const void *priv, uint8_t priv_len,
		 uint8_t initiator_depth, uint8_t responder_resources,
		 uint8_t retry_cnt, uint8_t rnr_retry);
int shim_accept(struct rdma_cm_id *id, uint32_t qp_num, const void *priv, uint8_t priv_len,
		uint8_t initiator_depth, uint8_t responder_resources, uint8_t rnr_retry);

struct ibv_cq *shim_create_cq(struct ibv_context *ctx, int entries, struct ibv_comp_channel *ch,
			      uint64_t handle);
int shim_cq_cqe(struct ibv_cq *cq);
// ibv_resize_cq: 0 or an errno; the granted size is then shim_cq_cqe.
int shim_resize_cq(struct ibv_cq *cq, int entries);
// Whether the device resizes a CQ (some drivers refuse ibv_resize_cq).
int shim_probe_resize_cq(struct ibv_context *ctx);

struct shim_async {
	int32_t event;
	uint64_t cq_handle; // for CQ events: the CQ's context
	uint32_t qp_num;    // for QP events
	uint64_t srq_handle; // for SRQ events: the SRQ's context
};
int shim_get_async_event(struct ibv_context *ctx, struct shim_async *out);
int shim_async_fd(struct ibv_context *ctx);
int shim_comp_channel_fd(struct ibv_comp_channel *ch);
int shim_cm_channel_fd(struct rdma_event_channel *ch);
int shim_set_nonblock(int fd);

struct shim_dev_attr {
	int max_qp_wr, max_sge, max_cqe, max_qp_rd_atom, max_qp_init_rd_atom;
	uint64_t max_mr_size;
	int max_srq, max_srq_wr;
	uint8_t phys_port_cnt;
};
int shim_query_device(struct ibv_context *ctx, struct shim_dev_attr *out);
const char *shim_dev_name(struct ibv_context *ctx);
// shim_query_gid_ipv4 writes the IPv4 address of an IPv4-mapped GID, or
// returns -1 if the entry is not one.
int shim_query_gid_ipv4(struct ibv_context *ctx, uint8_t port, int index, uint8_t out[4]);

// ibv_reg_mr is a macro over a static inline in rdma-core >= 33.
struct ibv_mr *shim_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t len, int access);
uint64_t shim_mr_addr(struct ibv_mr *mr);
// shim_probe_inline returns the largest inline size (from a list of
// candidates) a throw-away RC QP on ctx accepts, or 0.
int shim_probe_inline(struct ibv_context *ctx);

// Direct calls for Go (cgo cannot call through shim_lib's pointers).
struct ibv_pd *shim_ibv_alloc_pd(struct ibv_context *c);
int shim_ibv_dealloc_pd(struct ibv_pd *pd);
int shim_ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_comp_channel *shim_ibv_create_comp_channel(struct ibv_context *c);
int shim_ibv_destroy_comp_channel(struct ibv_comp_channel *ch);
int shim_ibv_destroy_cq(struct ibv_cq *cq);
int shim_ibv_destroy_qp(struct ibv_qp *qp);
const char *shim_ibv_port_state_str(int state);
struct rdma_event_channel *shim_rdma_create_event_channel(void);
void shim_rdma_destroy_event_channel(struct rdma_event_channel *ch);
int shim_rdma_destroy_id(struct rdma_cm_id *id);
int shim_rdma_disconnect(struct rdma_cm_id *id);
int shim_rdma_establish(struct rdma_cm_id *id);
const char *shim_rdma_event_str(int ev);
struct ibv_context **shim_rdma_get_devices(int *n);
void shim_rdma_free_devices(struct ibv_context **list);
int shim_rdma_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *ch);
int shim_rdma_reject(struct rdma_cm_id *id, const void *priv, uint8_t len);
int shim_rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms);

// shim_set_tos sets rdma_cm's RDMA_OPTION_ID_TOS on id (before its route
// is resolved, or on a listening id).
int shim_set_tos(struct rdma_cm_id *id, uint8_t tos);
// shim_qp_traffic_class is the GRH traffic class of qp's address vector
// (ibv_query_qp), or -1.
int shim_qp_traffic_class(struct ibv_qp *qp);

// shim_path is the path of a connected QP's address vector.
struct shim_path {
	uint8_t port, sgid_index, traffic_class, sl;
	int path_mtu; // enum ibv_mtu: 1 = 256 ... 5 = 4096
};
// shim_qp_path reads qp's path (ibv_query_qp).
int shim_qp_path(struct ibv_qp *qp, struct shim_path *out);
// shim_cm_path is the path rdma_cm would program at RTR for id, without
// programming it.
int shim_cm_path(struct rdma_cm_id *id, struct shim_path *out);
// shim_qp_rc_attrs reads qp's local ACK timeout, retry count and RNR
// retry (ibv_query_qp); 0 on success.
int shim_qp_rc_attrs(struct ibv_qp *qp, int *timeout, int *retry, int *rnr);

#endif
