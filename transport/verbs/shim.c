// See shim.h. Only thin adaptation lives here: no policy, no allocation.
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include "shim.h"

static const enum ibv_wr_opcode send_opcodes[] = {
	[SHIM_OP_SEND] = IBV_WR_SEND,
	[SHIM_OP_SEND_IMM] = IBV_WR_SEND_WITH_IMM,
	[SHIM_OP_WRITE] = IBV_WR_RDMA_WRITE,
	[SHIM_OP_WRITE_IMM] = IBV_WR_RDMA_WRITE_WITH_IMM,
	[SHIM_OP_READ] = IBV_WR_RDMA_READ,
};

int shim_post_send(struct ibv_qp *qp, const struct shim_send *wrs, int n,
		   const struct ibv_sge *sges, int *posted)
{
	struct ibv_send_wr batch[SHIM_POST_BATCH];
	const struct ibv_sge *sg = sges;
	int done = 0;

	*posted = 0;
	while (done < n) {
		int k = n - done < SHIM_POST_BATCH ? n - done : SHIM_POST_BATCH;
		struct ibv_send_wr *bad = NULL;
		int i, ret;

		memset(batch, 0, sizeof(batch[0]) * k);
		for (i = 0; i < k; i++) {
			const struct shim_send *w = &wrs[done + i];
			struct ibv_send_wr *b = &batch[i];

			if (w->opcode > SHIM_OP_READ)
				return EINVAL;
			b->wr_id = w->wr_id;
			b->next = i + 1 < k ? &batch[i + 1] : NULL;
			b->sg_list = (struct ibv_sge *)sg;
			b->num_sge = (int)w->nsge;
			sg += w->nsge;
			b->opcode = send_opcodes[w->opcode];
			if (w->flags & SHIM_F_SIGNALED)
				b->send_flags |= IBV_SEND_SIGNALED;
			if (w->flags & SHIM_F_INLINE)
				b->send_flags |= IBV_SEND_INLINE;
			if (w->opcode == SHIM_OP_SEND_IMM || w->opcode == SHIM_OP_WRITE_IMM)
				b->imm_data = htonl(w->imm);
			b->wr.rdma.remote_addr = w->remote_addr;
			b->wr.rdma.rkey = w->rkey;
		}
		ret = qp->context->ops.post_send(qp, batch, &bad);
		if (ret) {
			*posted = done + (bad ? (int)(bad - batch) : 0);
			return ret;
		}
		done += k;
		*posted = done;
	}
	return 0;
}

// post_recvs posts wrs to qp's receive queue, or to srq when it is set.
static int post_recvs(struct ibv_qp *qp, struct ibv_srq *srq, const struct shim_recv *wrs, int n,
		      const struct ibv_sge *sges, int *posted)
{
	struct ibv_recv_wr batch[SHIM_POST_BATCH];
	const struct ibv_sge *sg = sges;
	int done = 0;

	*posted = 0;
	while (done < n) {
		int k = n - done < SHIM_POST_BATCH ? n - done : SHIM_POST_BATCH;
		struct ibv_recv_wr *bad = NULL;
		int i, ret;

		for (i = 0; i < k; i++) {
			batch[i].wr_id = wrs[done + i].wr_id;
			batch[i].next = i + 1 < k ? &batch[i + 1] : NULL;
			batch[i].sg_list = (struct ibv_sge *)sg;
			batch[i].num_sge = (int)wrs[done + i].nsge;
			sg += wrs[done + i].nsge;
		}
		if (srq)
			ret = srq->context->ops.post_srq_recv(srq, batch, &bad);
		else
			ret = qp->context->ops.post_recv(qp, batch, &bad);
		if (ret) {
			*posted = done + (bad ? (int)(bad - batch) : 0);
			return ret;
		}
		done += k;
		*posted = done;
	}
	return 0;
}

int shim_post_recv(struct ibv_qp *qp, const struct shim_recv *wrs, int n,
		   const struct ibv_sge *sges, int *posted)
{
	return post_recvs(qp, NULL, wrs, n, sges, posted);
}

int shim_post_srq_recv(struct ibv_srq *srq, const struct shim_recv *wrs, int n,
		       const struct ibv_sge *sges, int *posted)
{
	return post_recvs(NULL, srq, wrs, n, sges, posted);
}

struct ibv_srq *shim_create_srq(struct ibv_pd *pd, uint64_t handle, uint32_t max_wr, uint32_t max_sge,
				uint32_t *granted_wr, uint32_t *granted_sge)
{
	struct ibv_srq_init_attr a;
	struct ibv_srq *srq;

	memset(&a, 0, sizeof(a));
	a.srq_context = (void *)(uintptr_t)handle;
	a.attr.max_wr = max_wr;
	a.attr.max_sge = max_sge;
	srq = shim_lib.ibv_create_srq(pd, &a);
	if (srq) {
		*granted_wr = a.attr.max_wr;
		*granted_sge = a.attr.max_sge;
	}
	return srq;
}

int shim_resize_srq(struct ibv_srq *srq, uint32_t max_wr)
{
	struct ibv_srq_attr a;

	memset(&a, 0, sizeof(a));
	a.max_wr = max_wr;
	return shim_lib.ibv_modify_srq(srq, &a, IBV_SRQ_MAX_WR);
}

int shim_arm_srq(struct ibv_srq *srq, uint32_t limit)
{
	struct ibv_srq_attr a;

	memset(&a, 0, sizeof(a));
	a.srq_limit = limit;
	return shim_lib.ibv_modify_srq(srq, &a, IBV_SRQ_LIMIT);
}

int shim_destroy_srq(struct ibv_srq *srq)
{
	return shim_lib.ibv_destroy_srq(srq);
}

static uint8_t wc_opcode(int op)
{
	switch (op) {
	case IBV_WC_SEND:
		return 0;
	case IBV_WC_RDMA_WRITE:
		return 1;
	case IBV_WC_RDMA_READ:
		return 2;
	case IBV_WC_RECV:
		return 3;
	case IBV_WC_RECV_RDMA_WITH_IMM:
		return 4;
	default:
		return 0xff;
	}
}

int shim_poll_cq(struct ibv_cq *cq, struct shim_wc *out, int n)
{
	struct ibv_wc wc[SHIM_POST_BATCH];
	int got = 0;

	while (got < n) {
		int want = n - got < SHIM_POST_BATCH ? n - got : SHIM_POST_BATCH;
		int k, i;

		// A driver may leave an error completion's opcode unwritten; a
		// stale one must not read as a receive (below).
		for (i = 0; i < want; i++)
			wc[i].opcode = IBV_WC_SEND;
		k = cq->context->ops.poll_cq(cq, want, wc);

		if (k < 0)
			return got ? got : k;
		for (i = 0; i < k; i++) {
			struct shim_wc *o = &out[got + i];

			memset(o, 0, sizeof(*o));
			o->id = wc[i].wr_id;
			o->status = (uint8_t)wc[i].status;
			o->qp_num = wc[i].qp_num;
			o->vendor_err = wc[i].vendor_err;
			if (wc[i].status != IBV_WC_SUCCESS) {
				// The opcode of an error completion is undefined,
				// but where the device says it ended a receive the
				// provider needs to know (srq.go).
				if (wc[i].opcode & IBV_WC_RECV)
					o->opcode = wc_opcode(wc[i].opcode);
				continue;
			}
			o->opcode = wc_opcode(wc[i].opcode);
			o->byte_len = wc[i].byte_len;
			if (wc[i].wc_flags & IBV_WC_WITH_IMM) {
				o->has_imm = 1;
				o->imm = ntohl(wc[i].imm_data);
			}
		}
		got += k;
		if (k < want)
			break;
	}
	return got;
}

int shim_req_notify_cq(struct ibv_cq *cq)
{
	return cq->context->ops.req_notify_cq(cq, 0);
}

// Returns 0 when an event was consumed, EAGAIN when the channel is empty,
// another errno on failure.
int shim_get_cq_event_of(struct ibv_comp_channel *ch, struct ibv_cq **cq, uint64_t *handle)
{
	void *ctx;

	if (shim_lib.ibv_get_cq_event(ch, cq, &ctx))
		return errno ? errno : EIO;
	*handle = (uint64_t)(uintptr_t)ctx;
	return 0;
}

void shim_ack_cq_events(struct ibv_cq *cq, unsigned int n)
{
	shim_lib.ibv_ack_cq_events(cq, n);
}

int shim_query_port(struct ibv_context *ctx, uint8_t port, struct shim_port *out)
{
	// Room beyond the declared attributes for fields newer libraries
	// write (see abi.h).
	union {
		struct ibv_port_attr a;
		uint8_t room[sizeof(struct ibv_port_attr) + 64];
	} buf;
	int ret;

	memset(&buf, 0, sizeof(buf));
	ret = shim_lib.ibv_query_port(ctx, port, &buf.a);
	if (ret)
		return ret;
	out->state = buf.a.state;
	out->link_layer = buf.a.link_layer;
	out->active_mtu = buf.a.active_mtu;
	out->gid_tbl_len = buf.a.gid_tbl_len;
	return 0;
}

int shim_get_cm_event(struct rdma_event_channel *ch, struct shim_event *out)
{
	struct rdma_cm_event *ev;
	uint32_t len;

	if (shim_lib.rdma_get_cm_event(ch, &ev))
		return errno ? errno : EIO;
	memset(out, 0, sizeof(*out));
	out->event = ev->event;
	out->status = ev->status;
	out->id = ev->id;
	out->handle = (uint64_t)(uintptr_t)ev->id->context;
	if (ev->listen_id)
		out->listen_handle = (uint64_t)(uintptr_t)ev->listen_id->context;
	len = ev->param.conn.private_data_len;
	if (ev->param.conn.private_data && len) {
		if (len > sizeof(out->private_data))
			len = sizeof(out->private_data);
		memcpy(out->private_data, ev->param.conn.private_data, len);
		out->private_len = len;
	}
	shim_lib.rdma_ack_cm_event(ev);
	return 0;
}

int shim_create_id(struct rdma_event_channel *ch, struct rdma_cm_id **id, uint64_t handle)
{
	if (shim_lib.rdma_create_id(ch, id, (void *)(uintptr_t)handle, RDMA_PS_TCP))
		return errno ? errno : EIO;
	return 0;
}

void shim_set_id_handle(struct rdma_cm_id *id, uint64_t handle)
{
	id->context = (void *)(uintptr_t)handle;
}

struct ibv_context *shim_id_verbs(struct rdma_cm_id *id)
{
	return id->verbs;
}

static void from_sockaddr(const struct sockaddr *sa, struct shim_addr *out)
{
	memset(out, 0, sizeof(*out));
	if (!sa)
		return;
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s = (const struct sockaddr_in *)sa;

		out->family = AF_INET;
		out->port = ntohs(s->sin_port);
		memcpy(out->ip, &s->sin_addr, 4);
	} else if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)sa;

		out->family = AF_INET6;
		out->port = ntohs(s->sin6_port);
		memcpy(out->ip, &s->sin6_addr, 16);
		out->scope_id = s->sin6_scope_id;
	}
}

static socklen_t to_sockaddr(const struct shim_addr *a, struct sockaddr_storage *ss)
{
	memset(ss, 0, sizeof(*ss));
	if (a->family == AF_INET6) {
		struct sockaddr_in6 *s = (struct sockaddr_in6 *)ss;

		s->sin6_family = AF_INET6;
		s->sin6_port = htons(a->port);
		memcpy(&s->sin6_addr, a->ip, 16);
		s->sin6_scope_id = a->scope_id;
		return sizeof(*s);
	}
	struct sockaddr_in *s = (struct sockaddr_in *)ss;

	s->sin_family = AF_INET;
	s->sin_port = htons(a->port);
	memcpy(&s->sin_addr, a->ip, 4);
	return sizeof(*s);
}

void shim_local_addr(struct rdma_cm_id *id, struct shim_addr *out)
{
	from_sockaddr((const struct sockaddr *)&id->route.addr.src_storage, out);
}

void shim_peer_addr(struct rdma_cm_id *id, struct shim_addr *out)
{
	from_sockaddr((const struct sockaddr *)&id->route.addr.dst_storage, out);
}

int shim_bind_listen(struct rdma_cm_id *id, const struct shim_addr *a, int backlog)
{
	struct sockaddr_storage ss;

	to_sockaddr(a, &ss);
	if (shim_lib.rdma_bind_addr(id, (struct sockaddr *)&ss))
		return errno ? errno : EIO;
	if (shim_lib.rdma_listen(id, backlog))
		return errno ? errno : EIO;
	return 0;
}

int shim_resolve_addr(struct rdma_cm_id *id, const struct shim_addr *dst, int timeout_ms)
{
	struct sockaddr_storage ss;

	to_sockaddr(dst, &ss);
	if (shim_lib.rdma_resolve_addr(id, NULL, (struct sockaddr *)&ss, timeout_ms))
		return errno ? errno : EIO;
	return 0;
}

struct ibv_context *shim_route_verbs(const struct shim_addr *dst, int timeout_ms, int *err)
{
	struct rdma_cm_id *id;
	struct sockaddr_storage ss;
	struct ibv_context *v = NULL;

	*err = 0;
	if (shim_lib.rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP)) {
		*err = errno ? errno : EIO;
		return NULL;
	}
	to_sockaddr(dst, &ss);
	if (shim_lib.rdma_resolve_addr(id, NULL, (struct sockaddr *)&ss, timeout_ms))
		*err = errno ? errno : EIO;
	else if (!(v = id->verbs))
		*err = ENODEV;
	shim_lib.rdma_destroy_id(id);
	return v;
}

struct ibv_qp *shim_create_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq,
			      struct ibv_srq *srq, const struct shim_qp_cfg *cfg,
			      struct shim_qp_cfg *actual)
{
	struct ibv_qp_init_attr a;
	struct ibv_qp *qp;

	memset(&a, 0, sizeof(a));
	a.send_cq = scq;
	a.recv_cq = rcq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 0;
	a.srq = srq;
	a.cap.max_send_wr = cfg->max_send_wr;
	a.cap.max_send_sge = cfg->max_send_sge;
	if (!srq) {
		a.cap.max_recv_wr = cfg->max_recv_wr;
		a.cap.max_recv_sge = cfg->max_recv_sge;
	}
	a.cap.max_inline_data = cfg->max_inline;
	qp = shim_lib.ibv_create_qp(pd, &a);
	if (!qp)
		return NULL;
	*actual = *cfg;
	actual->max_send_wr = a.cap.max_send_wr;
	actual->max_send_sge = a.cap.max_send_sge;
	if (!srq) {
		actual->max_recv_wr = a.cap.max_recv_wr;
		actual->max_recv_sge = a.cap.max_recv_sge;
	}
	actual->max_inline = a.cap.max_inline_data;
	return qp;
}

int shim_qp_to(struct rdma_cm_id *id, struct ibv_qp *qp, int state, const struct shim_qp_cfg *cfg)
{
	struct ibv_qp_attr attr;
	int mask = 0;

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = state;
	if (shim_lib.rdma_init_qp_attr(id, &attr, &mask))
		return errno ? errno : EIO;
	switch (state) {
	case IBV_QPS_INIT:
		// rdma_cm grants no remote access by default on the passive
		// side; the provider's MRs decide what a peer may touch.
		attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				       IBV_ACCESS_REMOTE_READ;
		mask |= IBV_QP_ACCESS_FLAGS;
		break;
	case IBV_QPS_RTR:
		attr.min_rnr_timer = cfg->min_rnr_timer;
		mask |= IBV_QP_MIN_RNR_TIMER;
		if (cfg->sl >= 0)
			attr.ah_attr.sl = (uint8_t)cfg->sl;
		if (cfg->sgid_index >= 0)
			attr.ah_attr.grh.sgid_index = (uint8_t)cfg->sgid_index;
		break;
	case IBV_QPS_RTS:
		attr.timeout = cfg->timeout;
		attr.retry_cnt = cfg->retry_cnt;
		attr.rnr_retry = cfg->rnr_retry;
		mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY;
		break;
	}
	return shim_lib.ibv_modify_qp(qp, &attr, mask);
}

int shim_qp_set_state(struct ibv_qp *qp, int state)
{
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = state;
	return shim_lib.ibv_modify_qp(qp, &attr, IBV_QP_STATE);
}

int shim_qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr attr;
	struct ibv_qp_init_attr init;

	if (shim_lib.ibv_query_qp(qp, &attr, IBV_QP_STATE, &init))
		return -1;
	return attr.qp_state;
}

int shim_connect(struct rdma_cm_id *id, uint32_t qp_num, const void *priv, uint8_t priv_len,
		 uint8_t initiator_depth, uint8_t responder_resources,
		 uint8_t retry_cnt, uint8_t rnr_retry)
{
	struct rdma_conn_param p;

	memset(&p, 0, sizeof(p));
	p.private_data = priv_len ? priv : NULL;
	p.private_data_len = priv_len;
	p.initiator_depth = initiator_depth;
	p.responder_resources = responder_resources;
	p.retry_count = retry_cnt;
	p.rnr_retry_count = rnr_retry;
	p.qp_num = qp_num;
	if (shim_lib.rdma_connect(id, &p))
		return errno ? errno : EIO;
	return 0;
}

int shim_accept(struct rdma_cm_id *id, uint32_t qp_num, const void *priv, uint8_t priv_len,
		uint8_t initiator_depth, uint8_t responder_resources, uint8_t rnr_retry)
{
	struct rdma_conn_param p;

	memset(&p, 0, sizeof(p));
	p.private_data = priv_len ? priv : NULL;
	p.private_data_len = priv_len;
	p.initiator_depth = initiator_depth;
	p.responder_resources = responder_resources;
	p.rnr_retry_count = rnr_retry;
	p.qp_num = qp_num;
	if (shim_lib.rdma_accept(id, &p))
		return errno ? errno : EIO;
	return 0;
}

struct ibv_cq *shim_create_cq(struct ibv_context *ctx, int entries, struct ibv_comp_channel *ch,
			      uint64_t handle)
{
	return shim_lib.ibv_create_cq(ctx, entries, (void *)(uintptr_t)handle, ch, 0);
}

int shim_cq_cqe(struct ibv_cq *cq)
{
	return cq->cqe;
}

int shim_resize_cq(struct ibv_cq *cq, int entries)
{
	int rc = shim_lib.ibv_resize_cq(cq, entries);

	// ibv_resize_cq returns the errno itself; some drivers set errno
	// and return -1.
	if (rc < 0)
		return errno ? errno : EIO;
	return rc;
}

int shim_probe_resize_cq(struct ibv_context *ctx)
{
	struct ibv_cq *cq = shim_lib.ibv_create_cq(ctx, 1, NULL, NULL, 0);
	int ok;

	if (!cq)
		return 0;
	ok = shim_lib.ibv_resize_cq(cq, cq->cqe + 1) == 0 && cq->cqe > 1;
	shim_lib.ibv_destroy_cq(cq);
	return ok;
}

int shim_get_async_event(struct ibv_context *ctx, struct shim_async *out)
{
	struct ibv_async_event ev;

	if (shim_lib.ibv_get_async_event(ctx, &ev))
		return errno ? errno : EIO;
	memset(out, 0, sizeof(*out));
	out->event = ev.event_type;
	switch (ev.event_type) {
	case IBV_EVENT_CQ_ERR:
		out->cq_handle = (uint64_t)(uintptr_t)ev.element.cq->cq_context;
		break;
	case IBV_EVENT_SRQ_LIMIT_REACHED:
	case IBV_EVENT_SRQ_ERR:
		out->srq_handle = (uint64_t)(uintptr_t)ev.element.srq->srq_context;
		break;
	case IBV_EVENT_QP_FATAL:
	case IBV_EVENT_QP_REQ_ERR:
	case IBV_EVENT_QP_ACCESS_ERR:
	case IBV_EVENT_COMM_EST:
	case IBV_EVENT_SQ_DRAINED:
	case IBV_EVENT_PATH_MIG:
	case IBV_EVENT_PATH_MIG_ERR:
	case IBV_EVENT_QP_LAST_WQE_REACHED:
		out->qp_num = ev.element.qp->qp_num;
		break;
	default:
		break;
	}
	shim_lib.ibv_ack_async_event(&ev);
	return 0;
}

int shim_async_fd(struct ibv_context *ctx)
{
	return ctx->async_fd;
}

int shim_comp_channel_fd(struct ibv_comp_channel *ch)
{
	return ch->fd;
}

int shim_cm_channel_fd(struct rdma_event_channel *ch)
{
	return ch->fd;
}

int shim_set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
		return errno;
	return 0;
}

int shim_query_device(struct ibv_context *ctx, struct shim_dev_attr *out)
{
	struct ibv_device_attr a;
	int ret = shim_lib.ibv_query_device(ctx, &a);

	if (ret)
		return ret;
	out->max_qp_wr = a.max_qp_wr;
	out->max_sge = a.max_sge;
	out->max_cqe = a.max_cqe;
	out->max_qp_rd_atom = a.max_qp_rd_atom;
	out->max_qp_init_rd_atom = a.max_qp_init_rd_atom;
	out->max_mr_size = a.max_mr_size;
	out->max_srq = a.max_srq;
	out->max_srq_wr = a.max_srq_wr;
	out->phys_port_cnt = a.phys_port_cnt;
	return 0;
}

const char *shim_dev_name(struct ibv_context *ctx)
{
	return shim_lib.ibv_get_device_name(ctx->device);
}

int shim_query_gid_ipv4(struct ibv_context *ctx, uint8_t port, int index, uint8_t out[4])
{
	static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	union ibv_gid gid;

	if (shim_lib.ibv_query_gid(ctx, port, index, &gid))
		return -1;
	if (memcmp(gid.raw, prefix, 12) != 0)
		return -1;
	memcpy(out, gid.raw + 12, 4);
	return 0;
}

struct ibv_mr *shim_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t len, int access)
{
	return shim_lib.ibv_reg_mr(pd, (void *)addr, len, access);
}

uint64_t shim_mr_addr(struct ibv_mr *mr)
{
	return (uint64_t)(uintptr_t)mr->addr;
}

int shim_probe_inline(struct ibv_context *ctx)
{
	static const uint32_t sizes[] = {4096, 2048, 1024, 512, 256, 128, 64};
	struct ibv_pd *pd = shim_lib.ibv_alloc_pd(ctx);
	struct ibv_cq *cq = pd ? shim_lib.ibv_create_cq(ctx, 1, NULL, NULL, 0) : NULL;
	int best = 0;
	size_t i;

	for (i = 0; cq && i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		struct ibv_qp_init_attr a;
		struct ibv_qp *qp;

		memset(&a, 0, sizeof(a));
		a.send_cq = cq;
		a.recv_cq = cq;
		a.qp_type = IBV_QPT_RC;
		a.cap.max_send_wr = 1;
		a.cap.max_recv_wr = 1;
		a.cap.max_send_sge = 1;
		a.cap.max_recv_sge = 1;
		a.cap.max_inline_data = sizes[i];
		qp = shim_lib.ibv_create_qp(pd, &a);
		if (qp) {
			best = (int)a.cap.max_inline_data;
			shim_lib.ibv_destroy_qp(qp);
			break;
		}
	}
	if (cq)
		shim_lib.ibv_destroy_cq(cq);
	if (pd)
		shim_lib.ibv_dealloc_pd(pd);
	return best;
}

// The library calls Go makes directly (cgo cannot call through a function
// pointer).
struct ibv_pd *shim_ibv_alloc_pd(struct ibv_context *c) { return shim_lib.ibv_alloc_pd(c); }
int shim_ibv_dealloc_pd(struct ibv_pd *pd) { return shim_lib.ibv_dealloc_pd(pd); }
int shim_ibv_dereg_mr(struct ibv_mr *mr) { return shim_lib.ibv_dereg_mr(mr); }
struct ibv_comp_channel *shim_ibv_create_comp_channel(struct ibv_context *c)
{
	return shim_lib.ibv_create_comp_channel(c);
}
int shim_ibv_destroy_comp_channel(struct ibv_comp_channel *ch)
{
	return shim_lib.ibv_destroy_comp_channel(ch);
}
int shim_ibv_destroy_cq(struct ibv_cq *cq) { return shim_lib.ibv_destroy_cq(cq); }
int shim_ibv_destroy_qp(struct ibv_qp *qp) { return shim_lib.ibv_destroy_qp(qp); }
const char *shim_ibv_port_state_str(int state) { return shim_lib.ibv_port_state_str(state); }
struct rdma_event_channel *shim_rdma_create_event_channel(void)
{
	return shim_lib.rdma_create_event_channel();
}
void shim_rdma_destroy_event_channel(struct rdma_event_channel *ch)
{
	shim_lib.rdma_destroy_event_channel(ch);
}
int shim_rdma_destroy_id(struct rdma_cm_id *id) { return shim_lib.rdma_destroy_id(id); }
int shim_rdma_disconnect(struct rdma_cm_id *id) { return shim_lib.rdma_disconnect(id); }
int shim_rdma_establish(struct rdma_cm_id *id) { return shim_lib.rdma_establish(id); }
const char *shim_rdma_event_str(int ev) { return shim_lib.rdma_event_str(ev); }
struct ibv_context **shim_rdma_get_devices(int *n) { return shim_lib.rdma_get_devices(n); }
void shim_rdma_free_devices(struct ibv_context **list) { shim_lib.rdma_free_devices(list); }
int shim_rdma_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *ch)
{
	return shim_lib.rdma_migrate_id(id, ch);
}
int shim_rdma_reject(struct rdma_cm_id *id, const void *priv, uint8_t len)
{
	return shim_lib.rdma_reject(id, priv, len);
}
int shim_rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms)
{
	return shim_lib.rdma_resolve_route(id, timeout_ms);
}

int shim_set_tos(struct rdma_cm_id *id, uint8_t tos)
{
	if (shim_lib.rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, sizeof(tos)))
		return errno ? errno : EIO;
	return 0;
}

int shim_qp_traffic_class(struct ibv_qp *qp)
{
	struct ibv_qp_attr attr;
	struct ibv_qp_init_attr init;

	memset(&attr, 0, sizeof(attr));
	if (shim_lib.ibv_query_qp(qp, &attr, IBV_QP_AV, &init))
		return -1;
	return attr.ah_attr.grh.traffic_class;
}

static void shim_path_of(const struct ibv_qp_attr *attr, struct shim_path *out)
{
	out->port = attr->ah_attr.port_num;
	out->sgid_index = attr->ah_attr.grh.sgid_index;
	out->traffic_class = attr->ah_attr.grh.traffic_class;
	out->sl = attr->ah_attr.sl;
	out->path_mtu = attr->path_mtu;
}

int shim_qp_path(struct ibv_qp *qp, struct shim_path *out)
{
	struct ibv_qp_attr attr;
	struct ibv_qp_init_attr init;

	memset(&attr, 0, sizeof(attr));
	if (shim_lib.ibv_query_qp(qp, &attr, IBV_QP_AV | IBV_QP_PATH_MTU, &init))
		return errno ? errno : EIO;
	shim_path_of(&attr, out);
	return 0;
}

int shim_cm_path(struct rdma_cm_id *id, struct shim_path *out)
{
	struct ibv_qp_attr attr;
	int mask = 0;

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = IBV_QPS_RTR;
	if (shim_lib.rdma_init_qp_attr(id, &attr, &mask))
		return errno ? errno : EIO;
	shim_path_of(&attr, out);
	return 0;
}

int shim_qp_rc_attrs(struct ibv_qp *qp, int *timeout, int *retry, int *rnr)
{
	struct ibv_qp_attr attr;
	struct ibv_qp_init_attr init;

	memset(&attr, 0, sizeof(attr));
	if (shim_lib.ibv_query_qp(qp, &attr, IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY, &init))
		return -1;
	*timeout = attr.timeout;
	*retry = attr.retry_cnt;
	*rnr = attr.rnr_retry;
	return 0;
}
