// Package fault is a transport provider that wraps another one and injects
// faults by rule, for the tests of everything above the transport:
// registrations refused, messages lost or corrupted, error completions,
// queue pairs moved to ERROR mid-stream, completions held back.
//
//	inj := fault.Wrap(shmProvider, "fault-shm")
//	h := inj.MustAdd(fault.Rule{Op: fault.OpPostSend, Action: fault.ActDrop,
//		Opcodes: []transport.Opcode{transport.OpSendWithImm}, Nth: 3})
//	dev, _ := inj.Open("")     // use dev exactly as a device of the inner provider
//	...
//	h.Fired()                  // how many times the rule acted
//
// Registering the injector with transport.Register is the caller's choice.
// Rules can be added and removed while traffic flows (Add, Handle.Remove).
//
// Every wrapped object keeps the inner provider's semantics when no rule
// fires: arm/notify, flushes, ordering, errors. To do so, the wrapper tags
// each posted work request with its own id (a per-QP sequence number) and
// restores the caller's id when the completion is polled; a rule can
// therefore see, for every completion, the request it completes.
//
// How each action is carried out, and what it costs in fidelity:
//
//   - ActFailReg: PD.RegMR returns Rule.Err (default ENOMEM) without
//     calling the inner provider.
//   - ActDrop: the request is replaced by a zero-length RDMA WRITE with the
//     same signaled flag, so the send queue keeps its order and a signaled
//     request still completes with success, with its own opcode and byte
//     count, as if the message had been acknowledged and then lost. This
//     breaks the guarantees of a reliable connection on purpose: nothing
//     arrives, no receive is consumed, nobody is told. It exists to test
//     protocol time-outs (an acknowledgement that never comes).
//   - ActCorrupt on OpPostSend: the payload is copied at post time into
//     staging memory the wrapper registered in the same PD, bits are
//     flipped in the copy (Offset, Mask), and the copy is sent. The
//     caller's buffer is never written. For an RDMA READ the corruption is
//     applied instead to the bytes that landed in the reader's memory,
//     when its completion is polled. Corrupted WRITE/SEND payloads must be
//     in memory registered through this wrapper (or the post fails with a
//     clear error).
//   - ActCorrupt on OpCompletion: flips bits in the bytes a successful
//     RECV or RDMA READ completion landed in local memory, before Poll
//     returns it.
//   - ActStatus: the completion carries Rule.Status and the QP goes to
//     ERROR, as with a NIC: later requests complete with StatusWRFlushErr.
//     On OpPostSend the request is not executed (it is replaced as for
//     ActDrop, signaled so that the error is always reported); from then
//     on QP.State reports ERROR and no later request executes (each is
//     replaced and reported flushed); the inner QP is moved to ERROR when
//     the failed completion is polled, so that the requests before it
//     still complete normally, and posted receives flush from then on.
//     On OpCompletion the request did execute (its data may have landed);
//     the completion and every later successful completion of that QP
//     polled afterwards are reported flushed, since the NIC would have
//     flushed them. Only the local QP is affected: the peer is not told.
//   - ActQPError: the QP is moved to ERROR (QP.SetError of the inner
//     provider) before the matching request is posted, or after the
//     matching completion. Injector.SetError does it on demand.
//   - ActDelay: the matching completion, and everything behind it on the
//     same CQ (order is kept), is held for Rule.Delay from the moment the
//     wrapper first polls it; CQ.Wait wakes when it becomes due. The inner
//     send queue slot is already retired while the completion is held.
//   - ActCount: does nothing; a rule that only counts events.
package fault
