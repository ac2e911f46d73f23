package transporttest

import "os"

// exitAbruptly ends a peer process without closing anything, as SIGKILL
// would: the kernel (verbs) or the socket hang-up (shm) must tell the
// other side.
func exitAbruptly() { os.Exit(3) }
