// The part of the libibverbs and librdmacm ABI this package uses, declared
// here so that building needs no rdma-core headers, and the libraries,
// loaded with dlopen at run time (load.c), are not link-time dependencies.
//
// Written for rdmagrpc from the public, stable user-space ABI of rdma-core
// (libibverbs IBVERBS_1.1, librdmacm RDMACM_1.0). rdma-core itself is
// dual-licensed GPL-2.0 / Linux-OpenIB (BSD); nothing of its text is
// copied here: these are the layouts and values any binary built against
// those libraries already carries, which is what interoperating requires.
//
// Rules that keep this small and safe:
//   - A structure that only the libraries allocate is declared up to the
//     last member we read (prefix declarations: ibv_context, ibv_cq,
//     ibv_qp, rdma_cm_id, rdma_cm_event). We never take sizeof of those.
//   - A structure we allocate and the library reads or writes is declared
//     whole (ibv_send_wr, ibv_qp_attr, ibv_wc, ...).
//   - testdata/abi_layout.c prints every offset, size and constant used
//     here; TestABIMatchesSystemHeaders compiles it against these
//     declarations and against rdma-core's headers, where installed, and
//     requires the two outputs to be identical.
#ifndef RDMAGRPC_VERBS_ABI_H
#define RDMAGRPC_VERBS_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

struct ibv_pd;
struct ibv_device;
struct ibv_srq;
struct ibv_ah;
struct ibv_mw;

// ---- libibverbs: constants ----

enum ibv_wr_opcode {
	IBV_WR_RDMA_WRITE = 0,
	IBV_WR_RDMA_WRITE_WITH_IMM = 1,
	IBV_WR_SEND = 2,
	IBV_WR_SEND_WITH_IMM = 3,
	IBV_WR_RDMA_READ = 4,
};

enum ibv_send_flags {
	IBV_SEND_SIGNALED = 1 << 1,
	IBV_SEND_INLINE = 1 << 3,
};

enum ibv_wc_opcode {
	IBV_WC_SEND = 0,
	IBV_WC_RDMA_WRITE = 1,
	IBV_WC_RDMA_READ = 2,
	IBV_WC_RECV = 1 << 7,
	IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1,
};

enum ibv_wc_status { IBV_WC_SUCCESS = 0 };

enum ibv_wc_flags { IBV_WC_WITH_IMM = 1 << 1 };

enum ibv_qp_type { IBV_QPT_RC = 2 };

enum ibv_qp_state {
	IBV_QPS_RESET = 0,
	IBV_QPS_INIT = 1,
	IBV_QPS_RTR = 2,
	IBV_QPS_RTS = 3,
	IBV_QPS_ERR = 6,
};

enum ibv_access_flags {
	IBV_ACCESS_LOCAL_WRITE = 1,
	IBV_ACCESS_REMOTE_WRITE = 1 << 1,
	IBV_ACCESS_REMOTE_READ = 1 << 2,
};

enum ibv_qp_attr_mask {
	IBV_QP_STATE = 1 << 0,
	IBV_QP_ACCESS_FLAGS = 1 << 3,
	IBV_QP_AV = 1 << 7,
	IBV_QP_PATH_MTU = 1 << 8,
	IBV_QP_TIMEOUT = 1 << 9,
	IBV_QP_RETRY_CNT = 1 << 10,
	IBV_QP_RNR_RETRY = 1 << 11,
	IBV_QP_MIN_RNR_TIMER = 1 << 15,
};

enum ibv_event_type {
	IBV_EVENT_CQ_ERR = 0,
	IBV_EVENT_QP_FATAL = 1,
	IBV_EVENT_QP_REQ_ERR = 2,
	IBV_EVENT_QP_ACCESS_ERR = 3,
	IBV_EVENT_COMM_EST = 4,
	IBV_EVENT_SQ_DRAINED = 5,
	IBV_EVENT_PATH_MIG = 6,
	IBV_EVENT_PATH_MIG_ERR = 7,
	IBV_EVENT_SRQ_ERR = 14,
	IBV_EVENT_SRQ_LIMIT_REACHED = 15,
	IBV_EVENT_QP_LAST_WQE_REACHED = 16,
};

enum ibv_port_state { IBV_PORT_ACTIVE = 4 };

// ---- libibverbs: structures ----

struct ibv_sge {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

struct ibv_send_wr {
	uint64_t wr_id;
	struct ibv_send_wr *next;
	struct ibv_sge *sg_list;
	int num_sge;
	int opcode; // enum ibv_wr_opcode
	unsigned int send_flags;
	uint32_t imm_data; // network order (union with invalidate_rkey)
	union {
		struct {
			uint64_t remote_addr;
			uint32_t rkey;
		} rdma;
		struct {
			uint64_t remote_addr, compare_add, swap;
			uint32_t rkey;
		} atomic;
		struct {
			struct ibv_ah *ah;
			uint32_t remote_qpn, remote_qkey;
		} ud;
	} wr;
	uint32_t xrc_remote_srqn;
	// Memory-window bind and TSO arguments, unused here: their union is
	// the largest member (mw, rkey, then {mr, addr, length, access}).
	struct {
		void *mw;
		uint32_t rkey;
		void *mr;
		uint64_t addr, length;
		unsigned int access;
	} bind_mw;
};

struct ibv_recv_wr {
	uint64_t wr_id;
	struct ibv_recv_wr *next;
	struct ibv_sge *sg_list;
	int num_sge;
};

struct ibv_wc {
	uint64_t wr_id;
	int status; // enum ibv_wc_status
	int opcode; // enum ibv_wc_opcode
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t imm_data; // network order
	uint32_t qp_num;
	uint32_t src_qp;
	unsigned int wc_flags;
	uint16_t pkey_index;
	uint16_t slid;
	uint8_t sl;
	uint8_t dlid_path_bits;
};

union ibv_gid {
	uint8_t raw[16];
	struct {
		uint64_t subnet_prefix, interface_id;
	} global;
};

struct ibv_qp_cap {
	uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct ibv_global_route {
	union ibv_gid dgid;
	uint32_t flow_label;
	uint8_t sgid_index, hop_limit, traffic_class;
};

struct ibv_ah_attr {
	struct ibv_global_route grh;
	uint16_t dlid;
	uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct ibv_qp_attr {
	int qp_state;     // enum ibv_qp_state
	int cur_qp_state; // enum ibv_qp_state
	int path_mtu;
	int path_mig_state;
	uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
	unsigned int qp_access_flags;
	struct ibv_qp_cap cap;
	struct ibv_ah_attr ah_attr, alt_ah_attr;
	uint16_t pkey_index, alt_pkey_index;
	uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic,
		min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
	uint32_t rate_limit;
};

struct ibv_qp_init_attr {
	void *qp_context;
	struct ibv_cq *send_cq, *recv_cq;
	struct ibv_srq *srq;
	struct ibv_qp_cap cap;
	int qp_type; // enum ibv_qp_type
	int sq_sig_all;
};

// The port attributes as ibv_query_port (IBVERBS_1.1) fills them. Newer
// libraries may write a few bytes more (port_cap_flags2, active_speed_ex):
// callers pass struct shim_port_buf, which leaves room for them.
struct ibv_port_attr {
	int state; // enum ibv_port_state
	int max_mtu, active_mtu;
	int gid_tbl_len;
	uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
	uint16_t pkey_tbl_len, lid, sm_lid;
	uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width,
		active_speed, phys_state, link_layer, flags;
};

struct ibv_device_attr {
	char fw_ver[64];
	uint64_t node_guid, sys_image_guid;
	uint64_t max_mr_size, page_size_cap;
	uint32_t vendor_id, vendor_part_id, hw_ver;
	int max_qp, max_qp_wr;
	unsigned int device_cap_flags;
	int max_sge, max_sge_rd, max_cq, max_cqe, max_mr, max_pd;
	int max_qp_rd_atom, max_ee_rd_atom, max_res_rd_atom;
	int max_qp_init_rd_atom, max_ee_init_rd_atom;
	int atomic_cap;
	int max_ee, max_rdd, max_mw, max_raw_ipv6_qp, max_raw_ethy_qp;
	int max_mcast_grp, max_mcast_qp_attach, max_total_mcast_qp_attach;
	int max_ah, max_fmr, max_map_per_fmr, max_srq, max_srq_wr, max_srq_sge;
	uint16_t max_pkeys;
	uint8_t local_ca_ack_delay, phys_port_cnt;
};

struct ibv_cq;
struct ibv_qp;

// The data-path verbs are static inlines in rdma-core's header that jump
// through the context's operation table; these are the table's slots.
struct ibv_context_ops {
	void *slots_0_10[11];
	int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
	int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
	void *slots_13_19[7];
	int (*post_srq_recv)(struct ibv_srq *srq, struct ibv_recv_wr *wr,
			     struct ibv_recv_wr **bad_wr);
	void *slots_21_24[4];
	int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
	int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
	void *slots_27_31[5];
};

// Prefix: allocated by libibverbs.
struct ibv_context {
	struct ibv_device *device;
	struct ibv_context_ops ops;
	int cmd_fd;
	int async_fd;
	int num_comp_vectors;
};

struct ibv_comp_channel {
	struct ibv_context *context;
	int fd;
	int refcnt;
};

// Prefix: allocated by libibverbs.
struct ibv_cq {
	struct ibv_context *context;
	struct ibv_comp_channel *channel;
	void *cq_context;
	uint32_t handle;
	int cqe;
};

// Prefix: allocated by libibverbs.
struct ibv_qp {
	struct ibv_context *context;
	void *qp_context;
	struct ibv_pd *pd;
	struct ibv_cq *send_cq, *recv_cq;
	struct ibv_srq *srq;
	uint32_t handle;
	uint32_t qp_num;
	int state;   // enum ibv_qp_state
	int qp_type; // enum ibv_qp_type
};

// Prefix: allocated by libibverbs.
struct ibv_srq {
	struct ibv_context *context;
	void *srq_context;
	struct ibv_pd *pd;
	uint32_t handle;
};

struct ibv_srq_attr {
	uint32_t max_wr, max_sge, srq_limit;
};

struct ibv_srq_init_attr {
	void *srq_context;
	struct ibv_srq_attr attr;
};

enum { IBV_SRQ_MAX_WR = 1 << 0, IBV_SRQ_LIMIT = 1 << 1 };

struct ibv_mr {
	struct ibv_context *context;
	struct ibv_pd *pd;
	void *addr;
	size_t length;
	uint32_t handle, lkey, rkey;
};

struct ibv_async_event {
	union {
		struct ibv_cq *cq;
		struct ibv_qp *qp;
		struct ibv_srq *srq;
		void *wq;
		int port_num;
	} element;
	int event_type; // enum ibv_event_type
};

// ---- librdmacm ----

enum rdma_port_space { RDMA_PS_TCP = 0x0106 };

// rdma_set_option: level RDMA_OPTION_ID, name RDMA_OPTION_ID_TOS, a uint8_t.
enum { RDMA_OPTION_ID = 0, RDMA_OPTION_ID_TOS = 0 };

enum rdma_cm_event_type {
	RDMA_CM_EVENT_ADDR_RESOLVED = 0,
	RDMA_CM_EVENT_ROUTE_RESOLVED = 2,
	RDMA_CM_EVENT_CONNECT_REQUEST = 4,
	RDMA_CM_EVENT_CONNECT_RESPONSE = 5,
	RDMA_CM_EVENT_REJECTED = 8,
	RDMA_CM_EVENT_ESTABLISHED = 9,
	RDMA_CM_EVENT_DISCONNECTED = 10,
};

struct rdma_event_channel {
	int fd;
};

// Prefix: allocated by librdmacm. The two addresses are rdma_get_local_addr
// and rdma_get_peer_addr, static inlines in rdma-core's header.
struct rdma_cm_id {
	struct ibv_context *verbs;
	struct rdma_event_channel *channel;
	void *context;
	struct ibv_qp *qp;
	struct {
		struct {
			struct sockaddr_storage src_storage;
			struct sockaddr_storage dst_storage;
		} addr;
	} route;
};

struct rdma_conn_param {
	const void *private_data;
	uint8_t private_data_len;
	uint8_t responder_resources;
	uint8_t initiator_depth;
	uint8_t flow_control;
	uint8_t retry_count;
	uint8_t rnr_retry_count;
	uint8_t srq;
	uint32_t qp_num;
};

// Prefix: allocated by librdmacm; param is a union whose conn member is
// the only one read (the ud member starts with the same two fields).
struct rdma_cm_event {
	struct rdma_cm_id *id;
	struct rdma_cm_id *listen_id;
	int event; // enum rdma_cm_event_type
	int status;
	union {
		struct rdma_conn_param conn;
	} param;
};

// ---- the functions, resolved by name with dlsym (load.c) ----
//
// X(return type, name, parameter list). Each becomes a member of
// struct shim_lib with the same name.
#define SHIM_IBVERBS_FUNCS(X)                                                                  \
	X(struct ibv_pd *, ibv_alloc_pd, (struct ibv_context *))                               \
	X(int, ibv_dealloc_pd, (struct ibv_pd *))                                              \
	X(struct ibv_mr *, ibv_reg_mr, (struct ibv_pd *, void *, size_t, int))                 \
	X(int, ibv_dereg_mr, (struct ibv_mr *))                                                \
	X(struct ibv_comp_channel *, ibv_create_comp_channel, (struct ibv_context *))         \
	X(int, ibv_destroy_comp_channel, (struct ibv_comp_channel *))                          \
	X(struct ibv_cq *, ibv_create_cq,                                                      \
	  (struct ibv_context *, int, void *, struct ibv_comp_channel *, int))                 \
	X(int, ibv_destroy_cq, (struct ibv_cq *))                                              \
	X(int, ibv_resize_cq, (struct ibv_cq *, int))                                          \
	X(int, ibv_get_cq_event, (struct ibv_comp_channel *, struct ibv_cq **, void **))       \
	X(void, ibv_ack_cq_events, (struct ibv_cq *, unsigned int))                            \
	X(struct ibv_qp *, ibv_create_qp, (struct ibv_pd *, struct ibv_qp_init_attr *))        \
	X(int, ibv_modify_qp, (struct ibv_qp *, struct ibv_qp_attr *, int))                    \
	X(int, ibv_query_qp, (struct ibv_qp *, struct ibv_qp_attr *, int,                      \
			      struct ibv_qp_init_attr *))                                      \
	X(int, ibv_destroy_qp, (struct ibv_qp *))                                              \
	X(struct ibv_srq *, ibv_create_srq, (struct ibv_pd *, struct ibv_srq_init_attr *))     \
	X(int, ibv_modify_srq, (struct ibv_srq *, struct ibv_srq_attr *, int))                 \
	X(int, ibv_destroy_srq, (struct ibv_srq *))                                            \
	X(int, ibv_query_device, (struct ibv_context *, struct ibv_device_attr *))             \
	X(int, ibv_query_port, (struct ibv_context *, uint8_t, struct ibv_port_attr *))        \
	X(int, ibv_query_gid, (struct ibv_context *, uint8_t, int, union ibv_gid *))           \
	X(const char *, ibv_get_device_name, (struct ibv_device *))                            \
	X(int, ibv_get_async_event, (struct ibv_context *, struct ibv_async_event *))          \
	X(void, ibv_ack_async_event, (struct ibv_async_event *))                               \
	X(const char *, ibv_port_state_str, (int))

#define SHIM_RDMACM_FUNCS(X)                                                                   \
	X(struct rdma_event_channel *, rdma_create_event_channel, (void))                      \
	X(void, rdma_destroy_event_channel, (struct rdma_event_channel *))                     \
	X(int, rdma_create_id, (struct rdma_event_channel *, struct rdma_cm_id **, void *, int)) \
	X(int, rdma_destroy_id, (struct rdma_cm_id *))                                         \
	X(int, rdma_migrate_id, (struct rdma_cm_id *, struct rdma_event_channel *))            \
	X(int, rdma_get_cm_event, (struct rdma_event_channel *, struct rdma_cm_event **))      \
	X(int, rdma_ack_cm_event, (struct rdma_cm_event *))                                    \
	X(const char *, rdma_event_str, (int))                                                 \
	X(int, rdma_bind_addr, (struct rdma_cm_id *, struct sockaddr *))                       \
	X(int, rdma_listen, (struct rdma_cm_id *, int))                                        \
	X(int, rdma_resolve_addr, (struct rdma_cm_id *, struct sockaddr *, struct sockaddr *,  \
				   int))                                                       \
	X(int, rdma_resolve_route, (struct rdma_cm_id *, int))                                 \
	X(int, rdma_connect, (struct rdma_cm_id *, struct rdma_conn_param *))                  \
	X(int, rdma_accept, (struct rdma_cm_id *, struct rdma_conn_param *))                   \
	X(int, rdma_reject, (struct rdma_cm_id *, const void *, uint8_t))                      \
	X(int, rdma_establish, (struct rdma_cm_id *))                                          \
	X(int, rdma_disconnect, (struct rdma_cm_id *))                                         \
	X(int, rdma_init_qp_attr, (struct rdma_cm_id *, struct ibv_qp_attr *, int *))          \
	X(int, rdma_set_option, (struct rdma_cm_id *, int, int, void *, size_t))              \
	X(struct ibv_context **, rdma_get_devices, (int *))                                    \
	X(void, rdma_free_devices, (struct ibv_context **))

#define SHIM_LIB_MEMBER(ret, name, params) ret(*name) params;
struct shim_lib {
	SHIM_IBVERBS_FUNCS(SHIM_LIB_MEMBER)
	SHIM_RDMACM_FUNCS(SHIM_LIB_MEMBER)
};
#undef SHIM_LIB_MEMBER

// Filled by shim_load; every shim function calls through it.
extern struct shim_lib shim_lib;

// shim_load opens libibverbs.so.1 and librdmacm.so.1 and resolves every
// function above. On failure it returns -1 with the reason in err (the
// dynamic loader's message, or the missing symbol) and leaves nothing
// loaded. Not safe to call concurrently (Go calls it under a sync.Once).
int shim_load(char *err, size_t errlen);
// shim_loaded reports whether every member of shim_lib is set.
int shim_loaded(void);

#endif
