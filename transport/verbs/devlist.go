package verbs

import (
	"strconv"
	"strings"

	"github.com/rdmagrpc/rdmagrpc/internal/settings"
)

// DevicesEnv restricts the devices and ports rdmagrpc's connections may
// use, in the form of NCCL_IB_HCA and UCX_NET_DEVICES: a comma-separated
// list of device names, each optionally with ":port"; a leading "^" makes
// it a list of exclusions. "mlx5_0:1,mlx5_1" uses port 1 of mlx5_0 and
// any port of mlx5_1; "^mlx5_2" anything but mlx5_2. Unset: every device.
// The provider's default device is the first one allowed, and a
// connection whose route goes through a device or port not allowed fails
// with an error that says so (rdma_cm routes by address: pick the
// addresses of the devices you want). Read at Open.
const DevicesEnv = settings.VerbsDevices

// devList is a parsed DevicesEnv; the zero value allows everything.
type devList struct {
	exclude bool
	entries []devEntry
}

type devEntry struct {
	name string
	port int // 0: any
}

func readDevList() (devList, error) {
	v, _ := settings.Get(DevicesEnv)
	return parseDevList(v)
}

func parseDevList(v string) (devList, error) {
	d, err := settings.ParseDevices(v)
	if err != nil {
		return devList{}, badSetting(err)
	}
	l := devList{exclude: d.Exclude}
	for _, e := range d.Entries {
		l.entries = append(l.entries, devEntry{name: e.Name, port: e.Port})
	}
	return l, nil
}

// allows reports whether port of device dev may be used; port 0 asks
// about the device as a whole (some port of it may be).
func (l devList) allows(dev string, port int) bool {
	if len(l.entries) == 0 {
		return true
	}
	for _, e := range l.entries {
		if e.name != dev {
			continue
		}
		if e.port == 0 || port == 0 || e.port == port {
			return !l.exclude || (e.port != 0 && port == 0)
		}
	}
	return l.exclude
}

func (l devList) String() string {
	if len(l.entries) == 0 {
		return "every device"
	}
	var b strings.Builder
	if l.exclude {
		b.WriteString("^")
	}
	for i, e := range l.entries {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(e.name)
		if e.port != 0 {
			b.WriteString(":" + strconv.Itoa(e.port))
		}
	}
	return b.String()
}
