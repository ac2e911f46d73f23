package bench

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Machine describes where the figures were measured.
type Machine struct {
	CPU        string
	Cores      int
	GOMAXPROCS int
	Kernel     string
	Go         string
	Date       time.Time
}

func describeMachine() Machine {
	m := Machine{CPU: "unknown CPU", Cores: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), Go: runtime.Version(), Date: time.Now()}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:])
	}
	return m
}

func (m Machine) String() string {
	return fmt.Sprintf("%s, %d cores (GOMAXPROCS %d), %s, %s", m.CPU, m.Cores, m.GOMAXPROCS, m.Kernel, m.Go)
}
