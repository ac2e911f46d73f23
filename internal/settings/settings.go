// Package settings holds every RDMAGRPC_* environment variable the
// library reads: its name, what it means, and how its value is parsed and
// checked. The packages that use a setting parse it here, and Check looks
// at all of them at once (conn runs it at the first Listen or Dial,
// rdmatrace doctor prints it), so that a value is read the same way
// everywhere and a bad one is an error wherever it is noticed.
//
// The variables of the demo, the benchmarks and the test harnesses
// (Tools) are not the library's: Check neither parses nor warns about
// them.
package settings

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Names of the library's settings.
const (
	Provider       = "RDMAGRPC_PROVIDER"
	Log            = "RDMAGRPC_LOG"
	RegBudget      = "RDMAGRPC_REG_BUDGET"
	VerbsDevices   = "RDMAGRPC_VERBS_DEVICES"
	VerbsTC        = "RDMAGRPC_VERBS_TC"
	VerbsTimeout   = "RDMAGRPC_VERBS_TIMEOUT"
	VerbsRetryCnt  = "RDMAGRPC_VERBS_RETRY_CNT"
	VerbsRNRRetry  = "RDMAGRPC_VERBS_RNR_RETRY"
	VerbsMinRNR    = "RDMAGRPC_VERBS_MIN_RNR_TIMER"
	VerbsSL        = "RDMAGRPC_VERBS_SL"
	VerbsGIDIndex  = "RDMAGRPC_VERBS_GID_INDEX"
	VerbsRoCEVer   = "RDMAGRPC_VERBS_ROCE_VERSION"
	VerbsSendDepth = "RDMAGRPC_VERBS_SEND_DEPTH"
	VerbsRecvDepth = "RDMAGRPC_VERBS_RECV_DEPTH"
	VerbsCQShare   = "RDMAGRPC_VERBS_CQ_SHARE"
	VerbsRecvPool  = "RDMAGRPC_VERBS_RECV_POOL"
	ShmDir         = "RDMAGRPC_SHM_DIR"
	prefix         = "RDMAGRPC_"
	providerAccept = "verbs or shm (either case)"
)

// Var is one setting.
type Var struct {
	Name    string
	Meaning string // one line
	Accepts string // the values accepted, as an error message says it
	check   func(string) error
}

// Vars lists the library's settings.
var Vars = []Var{
	{Provider, "the transport provider: verbs (RDMA) or shm (shared memory between processes of this host); unset: verbs where an RDMA device is usable, else shm", providerAccept,
		func(v string) error { _, err := ParseProvider(v); return err }},
	{Log, "log rdmagrpc's records from this level up to standard error; unset: nothing is logged", "debug, info, warn or error",
		func(v string) error { _, err := ParseLogLevel(v); return err }},
	{RegBudget, "bound on the memory all connections of the process register (pin); 0: unlimited; unset: 1g", "a number of bytes with an optional k, m or g suffix (powers of 1024), 0 for unlimited",
		func(v string) error { _, err := ParseSize(v); return err }},
	{VerbsDevices, "the RDMA devices and ports verbs may use, as NCCL_IB_HCA: mlx5_0:1,mlx5_1 or ^mlx5_2 (all but); unset: all", "a comma-separated list of device[:port], optionally led by ^",
		func(v string) error { _, err := ParseDevices(v); return err }},
	{ShmDir, "a directory the processes of this host share across network namespaces (a volume two pods mount): shm listeners bind a socket there too, and dialers look there for an address of another namespace; unset: none", "an absolute path of a directory",
		CheckShmDir},
	{VerbsTC, "the IP traffic class (DSCP × 4 + ECN) of RoCE traffic, as NCCL_IB_TC; unset: 0", "a traffic class from 0 to 255 (DSCP × 4, e.g. 106 for DSCP 26 with ECN)",
		func(v string) error { _, err := ParseTrafficClass(v); return err }},
}

type rangedVar struct {
	name, meaning string
	min, max      int
}

// ranged are the verbs queue-pair attributes: numbers within a range.
var ranged = []rangedVar{
	{VerbsTimeout, "the local ACK timeout exponent, 4.096 µs × 2^n, as NCCL_IB_TIMEOUT; unset: 14", 0, 31},
	{VerbsRetryCnt, "transport retries before \"retry counter exceeded\", as NCCL_IB_RETRY_CNT; unset: 7", 0, 7},
	{VerbsRNRRetry, "receiver-not-ready retries, 7 meaning forever; unset: 6", 0, 7},
	{VerbsMinRNR, "the RNR NAK timer asked of the sender, as the IB code (14: 1.28 ms); unset: 14", 0, 31},
	{VerbsSL, "the service level of the address vector, as NCCL_IB_SL; unset: rdma_cm's", 0, 15},
	{VerbsGIDIndex, "the source GID index, as NCCL_IB_GID_INDEX; unset: the one rdma_cm picks", 0, 255},
	{VerbsRoCEVer, "the RoCE version of the source GID (GID_INDEX wins over it); unset: rdma_cm's, normally 2", 1, 2},
	{VerbsSendDepth, "the send work requests a queue pair keeps on the device, the rest of its depth held by the provider; 0: all of it on the device; unset: 7", 0, 1 << 15},
	{VerbsRecvDepth, "the depth of the shared receive queue a queue pair starts with, grown to the depth asked for when full; 0: a receive queue of its own, of the full depth; unset: 31", 0, 1 << 15},
	{VerbsCQShare, "how many connections' completion queues one device completion queue serves; 1: one of its own each; unset: 238", 1, 1 << 15},
	{VerbsRecvPool, "the receives one shared receive queue per device keeps posted for every connection (a connection's receives carry no data); 0: a queue per connection (RDMAGRPC_VERBS_RECV_DEPTH); unset: 511", 0, 1 << 15},
}

func init() {
	for _, r := range ranged {
		Vars = append(Vars, Var{r.name, r.meaning, fmt.Sprintf("a number from %d to %d", r.min, r.max),
			func(v string) error { _, err := parseRange(r.name, v); return err }})
	}
}

// Tools lists the RDMAGRPC_* variables of the demo, the benchmarks and
// the test harnesses: not the library's, so neither checked nor taken for
// misspellings. A name ending in "_" stands for every name it begins.
var Tools = []string{
	"RDMAGRPC_DEMO_ADDR",  // cmd/demo
	"RDMAGRPC_BENCH_HOST", // bench
	"RDMAGRPC_RXE",        // tests/rxe
	"RDMAGRPC_RXE_",
	// tests
	"RDMAGRPC_CONN_TEST_", "RDMAGRPC_INTEROP_", "RDMAGRPC_MIXED_FLEET", "RDMAGRPC_PEERCHECK_DIAL",
	"RDMAGRPC_SOAK", "RDMAGRPC_SOAK_CONNS", "RDMAGRPC_SOAK_DUMP",
	"RDMAGRPC_SHM_TEST_PEER", "RDMAGRPC_SHM_SQUAT", "RDMAGRPC_SHM_FREEZE", "RDMAGRPC_SHM_FREEZE_TO",
	"RDMAGRPC_SHM_ISO", "RDMAGRPC_SHM_ISO_ADDR", "RDMAGRPC_SHM_ISO_LAUNCHER",
	"RDMAGRPC_VERBS_ADDR", "RDMAGRPC_VERBS_MEMLOCK_CHILD",
}

// IsTool says whether name is one of Tools.
func IsTool(name string) bool {
	for _, t := range Tools {
		if name == t || strings.HasSuffix(t, "_") && strings.HasPrefix(name, t) {
			return true
		}
	}
	return false
}

// Lookup finds a library setting by name.
func Lookup(name string) (Var, bool) {
	i := slices.IndexFunc(Vars, func(v Var) bool { return v.Name == name })
	if i < 0 {
		return Var{}, false
	}
	return Vars[i], true
}

// Error is a bad value: it names the variable, the value and what is
// accepted, and it is a transport.ErrBadSetting.
type Error struct {
	Name, Value string
	Accepts     string // what is accepted, or why the value cannot be
}

func (e *Error) Error() string { return fmt.Sprintf("%s=%q: want %s", e.Name, e.Value, e.Accepts) }

// Is makes every Error a transport.ErrBadSetting.
func (e *Error) Is(target error) bool { return target == transport.ErrBadSetting }

// Get returns the value of name with spaces trimmed, and whether it is
// set to something (an empty value is as good as unset).
func Get(name string) (string, bool) {
	v := strings.TrimSpace(os.Getenv(name))
	return v, v != ""
}

// ParseProvider returns the provider a value names, in lower case: verbs
// or shm. "tcp" is refused with the way to plain TCP.
func ParseProvider(v string) (string, error) {
	switch s := strings.ToLower(strings.TrimSpace(v)); s {
	case "verbs", "shm":
		return s, nil
	case "tcp":
		return "", &Error{Provider, v, providerAccept + ": " + NotTCP}
	default:
		return "", &Error{Provider, v, providerAccept}
	}
}

// NotTCP explains why tcp cannot be chosen as a provider.
const NotTCP = `tcp is not a provider but what a connection stays on when the peer cannot have RDMA (Stats().Provider "tcp"); ` +
	"leave the provider unset to get RDMA where both ends have it and TCP elsewhere, or, for TCP only, use grpc's own dialer and net.Listen"

// ProviderName is RDMAGRPC_PROVIDER parsed: "" when unset.
func ProviderName() (string, error) {
	v, ok := Get(Provider)
	if !ok {
		return "", nil
	}
	return ParseProvider(v)
}

// ParseLogLevel parses a level as log/slog does (debug, info, warn,
// error, either case, with an optional offset such as warn+2).
func ParseLogLevel(v string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(strings.TrimSpace(v))); err != nil {
		return 0, &Error{Log, v, "debug, info, warn or error"}
	}
	return l, nil
}

// ParseSize parses a byte count with an optional k, m or g suffix (powers
// of 1024, case-insensitive, an optional trailing "b" or "ib").
func ParseSize(s string) (int64, error) {
	bad := &Error{RegBudget, s, "a number of bytes with an optional k, m or g suffix (powers of 1024), 0 for unlimited"}
	t := strings.ToLower(strings.TrimSpace(s))
	t = strings.TrimSuffix(t, "ib")
	t = strings.TrimSuffix(t, "b")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'k':
			mult = 1 << 10
		case 'm':
			mult = 1 << 20
		case 'g':
			mult = 1 << 30
		}
		if mult != 1 {
			t = t[:n-1]
		}
	}
	v, err := strconv.ParseInt(t, 10, 64)
	if err != nil || v < 0 {
		return 0, bad
	}
	if v > (1<<63-1)/mult {
		bad.Accepts = "a size that fits in 63 bits (this one overflows)"
		return 0, bad
	}
	return v * mult, nil
}

// ParseTrafficClass parses an IP traffic class, 0–255, in decimal or
// with a 0x or 0 prefix.
func ParseTrafficClass(v string) (int, error) {
	n, err := strconv.ParseUint(strings.TrimSpace(v), 0, 8)
	if err != nil {
		return 0, &Error{VerbsTC, v, "a traffic class from 0 to 255 (DSCP × 4, e.g. 106 for DSCP 26 with ECN)"}
	}
	return int(n), nil
}

// Devices is RDMAGRPC_VERBS_DEVICES parsed; the zero value allows every
// device.
type Devices struct {
	Exclude bool // the entries are the devices not to use
	Entries []Device
}

// Device is one entry of Devices.
type Device struct {
	Name string
	Port int // 0: any
}

// ParseDevices parses a list of device[:port], optionally led by ^.
func ParseDevices(v string) (Devices, error) {
	var l Devices
	s := strings.TrimSpace(v)
	if rest, ok := strings.CutPrefix(s, "^"); ok {
		l.Exclude, s = true, rest
	}
	if s == "" {
		if l.Exclude {
			return l, &Error{VerbsDevices, v, "a device after ^"}
		}
		return l, nil
	}
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		name, port, hasPort := strings.Cut(item, ":")
		e := Device{Name: name}
		if hasPort {
			n, err := strconv.Atoi(port)
			if err != nil || n < 1 || n > 255 {
				return l, &Error{VerbsDevices, v, fmt.Sprintf("a port number from 1 to 255 in %q", item)}
			}
			e.Port = n
		}
		if e.Name == "" {
			return l, &Error{VerbsDevices, v, "a device name in every entry (this one has an empty one)"}
		}
		l.Entries = append(l.Entries, e)
	}
	return l, nil
}

// Range returns the number a ranged verbs setting holds, and whether it
// is set.
func Range(name string) (int, bool, error) {
	v, ok := Get(name)
	if !ok {
		return 0, false, nil
	}
	n, err := parseRange(name, v)
	return n, true, err
}

func parseRange(name, v string) (int, error) {
	i := slices.IndexFunc(ranged, func(r rangedVar) bool { return r.name == name })
	if i < 0 {
		panic("settings: " + name + " is not a ranged setting")
	}
	r := ranged[i]
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < r.min || n > r.max {
		return 0, &Error{name, v, fmt.Sprintf("a number from %d to %d", r.min, r.max)}
	}
	return n, nil
}

// CheckShmDir checks a socket directory: an absolute path of a directory.
func CheckShmDir(v string) error {
	if !filepath.IsAbs(v) {
		return &Error{Name: ShmDir, Value: v, Accepts: "an absolute path of a directory"}
	}
	if fi, err := os.Stat(v); err != nil || !fi.IsDir() {
		return &Error{Name: ShmDir, Value: v, Accepts: "an absolute path of a directory that exists"}
	}
	return nil
}
