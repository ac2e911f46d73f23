// Prints the offsets, sizes and constants abi.h declares. Compiled twice by
// TestABIMatchesSystemHeaders: with -DSYSTEM against rdma-core's headers,
// and without against abi.h; the two outputs must be identical.
#include <stdio.h>
#ifdef SYSTEM
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#else
#include "../abi.h"
#endif

#define OFF(t, m) printf("offsetof(%s, %s) = %zu\n", #t, #m, offsetof(t, m));
#define SIZE(t) printf("sizeof(%s) = %zu\n", #t, sizeof(t));
#define VAL(c) printf("%s = %ld\n", #c, (long)(c));

int main(void)
{
	// Allocated by us, read or written by the libraries: whole.
	SIZE(struct ibv_sge)
	OFF(struct ibv_sge, length) OFF(struct ibv_sge, lkey)
	SIZE(struct ibv_send_wr)
	OFF(struct ibv_send_wr, next) OFF(struct ibv_send_wr, sg_list)
	OFF(struct ibv_send_wr, num_sge) OFF(struct ibv_send_wr, opcode)
	OFF(struct ibv_send_wr, send_flags) OFF(struct ibv_send_wr, imm_data)
	OFF(struct ibv_send_wr, wr.rdma.remote_addr) OFF(struct ibv_send_wr, wr.rdma.rkey)
	SIZE(struct ibv_recv_wr)
	OFF(struct ibv_recv_wr, next) OFF(struct ibv_recv_wr, sg_list) OFF(struct ibv_recv_wr, num_sge)
	SIZE(struct ibv_wc)
	OFF(struct ibv_wc, status) OFF(struct ibv_wc, opcode) OFF(struct ibv_wc, vendor_err)
	OFF(struct ibv_wc, byte_len) OFF(struct ibv_wc, imm_data) OFF(struct ibv_wc, qp_num)
	OFF(struct ibv_wc, wc_flags)
	SIZE(union ibv_gid)
	SIZE(struct ibv_qp_attr)
	OFF(struct ibv_qp_attr, qp_access_flags) OFF(struct ibv_qp_attr, cap)
	OFF(struct ibv_qp_attr, ah_attr) OFF(struct ibv_qp_attr, min_rnr_timer)
	OFF(struct ibv_qp_attr, timeout) OFF(struct ibv_qp_attr, retry_cnt)
	OFF(struct ibv_qp_attr, rnr_retry) OFF(struct ibv_qp_attr, rate_limit)
	SIZE(struct ibv_qp_init_attr)
	OFF(struct ibv_qp_init_attr, send_cq) OFF(struct ibv_qp_init_attr, recv_cq)
	OFF(struct ibv_qp_init_attr, cap.max_send_wr) OFF(struct ibv_qp_init_attr, cap.max_inline_data)
	OFF(struct ibv_qp_init_attr, qp_type) OFF(struct ibv_qp_init_attr, sq_sig_all)
	SIZE(struct ibv_device_attr)
	OFF(struct ibv_device_attr, max_mr_size) OFF(struct ibv_device_attr, max_qp_wr)
	OFF(struct ibv_device_attr, max_sge) OFF(struct ibv_device_attr, max_cqe)
	OFF(struct ibv_device_attr, max_qp_rd_atom) OFF(struct ibv_device_attr, max_qp_init_rd_atom)
	OFF(struct ibv_device_attr, phys_port_cnt)
	SIZE(struct ibv_async_event)
	OFF(struct ibv_async_event, event_type)
	SIZE(struct ibv_comp_channel)
	OFF(struct ibv_comp_channel, fd)
	SIZE(struct ibv_mr)
	OFF(struct ibv_mr, addr) OFF(struct ibv_mr, lkey) OFF(struct ibv_mr, rkey)
	SIZE(struct rdma_conn_param)
	OFF(struct rdma_conn_param, private_data_len) OFF(struct rdma_conn_param, responder_resources)
	OFF(struct rdma_conn_param, initiator_depth) OFF(struct rdma_conn_param, retry_count)
	OFF(struct rdma_conn_param, rnr_retry_count) OFF(struct rdma_conn_param, qp_num)
	SIZE(struct rdma_event_channel)

	// Filled by the library whose size may grow: the members read.
	OFF(struct ibv_port_attr, state) OFF(struct ibv_port_attr, active_mtu)
	OFF(struct ibv_port_attr, gid_tbl_len) OFF(struct ibv_port_attr, link_layer)

	// Allocated by the libraries: the prefix read.
	OFF(struct ibv_context, device) OFF(struct ibv_context, ops.poll_cq)
	OFF(struct ibv_context, ops.req_notify_cq) OFF(struct ibv_context, ops.post_send)
	OFF(struct ibv_context, ops.post_recv) OFF(struct ibv_context, async_fd)
	OFF(struct ibv_context, ops.post_srq_recv)
	OFF(struct ibv_srq, context) OFF(struct ibv_srq_init_attr, attr.max_wr)
	OFF(struct ibv_srq_init_attr, attr.max_sge) OFF(struct ibv_srq_attr, srq_limit)
	OFF(struct ibv_qp_init_attr, srq) OFF(struct ibv_device_attr, max_srq)
	OFF(struct ibv_device_attr, max_srq_wr)
	OFF(struct ibv_cq, context) OFF(struct ibv_cq, cq_context) OFF(struct ibv_cq, cqe)
	OFF(struct ibv_qp, context) OFF(struct ibv_qp, qp_num)
	OFF(struct rdma_cm_id, verbs) OFF(struct rdma_cm_id, context)
	OFF(struct rdma_cm_id, route.addr.src_storage) OFF(struct rdma_cm_id, route.addr.dst_storage)
	OFF(struct rdma_cm_event, id) OFF(struct rdma_cm_event, listen_id)
	OFF(struct rdma_cm_event, event) OFF(struct rdma_cm_event, status)
	OFF(struct rdma_cm_event, param.conn.private_data)
	OFF(struct rdma_cm_event, param.conn.private_data_len)

	VAL(IBV_WR_RDMA_WRITE) VAL(IBV_WR_RDMA_WRITE_WITH_IMM) VAL(IBV_WR_SEND)
	VAL(IBV_WR_SEND_WITH_IMM) VAL(IBV_WR_RDMA_READ)
	VAL(IBV_SEND_SIGNALED) VAL(IBV_SEND_INLINE)
	VAL(IBV_WC_SEND) VAL(IBV_WC_RDMA_WRITE) VAL(IBV_WC_RDMA_READ) VAL(IBV_WC_RECV)
	VAL(IBV_WC_RECV_RDMA_WITH_IMM) VAL(IBV_WC_SUCCESS) VAL(IBV_WC_WITH_IMM)
	VAL(IBV_QPT_RC) VAL(IBV_QPS_RESET) VAL(IBV_QPS_INIT) VAL(IBV_QPS_RTR) VAL(IBV_QPS_RTS)
	VAL(IBV_QPS_ERR)
	VAL(IBV_ACCESS_LOCAL_WRITE) VAL(IBV_ACCESS_REMOTE_WRITE) VAL(IBV_ACCESS_REMOTE_READ)
	VAL(IBV_QP_STATE) VAL(IBV_QP_ACCESS_FLAGS) VAL(IBV_QP_TIMEOUT) VAL(IBV_QP_RETRY_CNT)
	VAL(IBV_QP_RNR_RETRY) VAL(IBV_QP_MIN_RNR_TIMER)
	VAL(IBV_EVENT_CQ_ERR) VAL(IBV_EVENT_QP_FATAL) VAL(IBV_EVENT_QP_REQ_ERR)
	VAL(IBV_EVENT_QP_ACCESS_ERR) VAL(IBV_EVENT_COMM_EST) VAL(IBV_EVENT_SQ_DRAINED)
	VAL(IBV_EVENT_PATH_MIG) VAL(IBV_EVENT_PATH_MIG_ERR) VAL(IBV_EVENT_QP_LAST_WQE_REACHED)
	VAL(IBV_PORT_ACTIVE) VAL(IBV_SRQ_MAX_WR)
	VAL(RDMA_PS_TCP) VAL(RDMA_OPTION_ID) VAL(RDMA_OPTION_ID_TOS) VAL(IBV_QP_AV)
	OFF(struct ibv_qp_attr, ah_attr.grh.traffic_class)
	VAL(RDMA_CM_EVENT_ADDR_RESOLVED) VAL(RDMA_CM_EVENT_ROUTE_RESOLVED)
	VAL(RDMA_CM_EVENT_CONNECT_REQUEST) VAL(RDMA_CM_EVENT_CONNECT_RESPONSE)
	VAL(RDMA_CM_EVENT_REJECTED) VAL(RDMA_CM_EVENT_ESTABLISHED) VAL(RDMA_CM_EVENT_DISCONNECTED)
	return 0;
}
