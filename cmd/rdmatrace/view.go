package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	tea "github.com/charmbracelet/bubbletea"
	"github.com/charmbracelet/lipgloss"

	"github.com/rdmagrpc/rdmagrpc/bpf"
	"github.com/rdmagrpc/rdmagrpc/conn"
)

// The live view: a bubbletea model fed by the tracer's events.

type (
	eventsMsg []bpf.Event
	tickMsg   time.Time
	readErr   struct{ err error }
)

type model struct {
	st       *stats
	src      <-chan bpf.Event
	errc     <-chan error
	tr       *bpf.Tracer
	notes    []string // what could not be probed at start
	watch    *watcher // nil: --binary or --pid
	scope    string
	interval time.Duration
	started  time.Time
	until    time.Time // zero: until the user quits

	sort       sortKey
	asc        bool
	hideExited bool
	filter     string
	editing    bool // typing a filter
	draft      string
	selected   int
	width      int
	height     int
	err        error
	lastStats  bpf.Stats
}

var (
	titleStyle  = lipgloss.NewStyle().Bold(true).Foreground(lipgloss.Color("12"))
	headerStyle = lipgloss.NewStyle().Bold(true).Underline(true)
	selStyle    = lipgloss.NewStyle().Reverse(true)
	dimStyle    = lipgloss.NewStyle().Faint(true)
	warnStyle   = lipgloss.NewStyle().Foreground(lipgloss.Color("9")).Bold(true)
)

func (m *model) Init() tea.Cmd {
	return tea.Batch(m.wait(), m.tick())
}

// wait blocks for the next event, then takes whatever else is queued so
// one screen update covers a burst.
func (m *model) wait() tea.Cmd {
	return func() tea.Msg {
		ev, ok := <-m.src
		if !ok {
			return readErr{<-m.errc}
		}
		batch := eventsMsg{ev}
		for len(batch) < 4096 {
			select {
			case ev, ok := <-m.src:
				if !ok {
					return batch
				}
				batch = append(batch, ev)
			default:
				return batch
			}
		}
		return batch
	}
}

func (m *model) tick() tea.Cmd {
	return tea.Tick(m.interval, func(t time.Time) tea.Msg { return tickMsg(t) })
}

func (m *model) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case eventsMsg:
		for _, ev := range msg {
			m.st.add(ev)
		}
		return m, m.wait()
	case readErr:
		m.err = msg.err
		return m, nil
	case tickMsg:
		now := time.Time(msg)
		m.st.tick(now)
		m.st.markExited(processAlive)
		if s, err := m.tr.Stats(); err == nil {
			m.lastStats = s
		}
		if !m.until.IsZero() && !now.Before(m.until) {
			return m, tea.Quit
		}
		return m, m.tick()
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
		return m, nil
	case tea.KeyMsg:
		return m.key(msg)
	}
	return m, nil
}

func (m *model) key(k tea.KeyMsg) (tea.Model, tea.Cmd) {
	// Keys typed faster than the terminal is read arrive as one message
	// ("/abc"); take them one at a time so "/" still opens the filter.
	if k.Type == tea.KeyRunes && len(k.Runes) > 1 && !k.Paste {
		var cmds []tea.Cmd
		for _, r := range k.Runes {
			_, cmd := m.key(tea.KeyMsg{Type: tea.KeyRunes, Runes: []rune{r}, Alt: k.Alt})
			cmds = append(cmds, cmd)
		}
		return m, tea.Batch(cmds...)
	}
	if m.editing {
		switch k.Type {
		case tea.KeyEnter:
			m.filter, m.editing = m.draft, false
		case tea.KeyEsc:
			m.editing = false
		case tea.KeyBackspace:
			if m.draft != "" {
				m.draft = m.draft[:len(m.draft)-1]
			}
		case tea.KeyRunes, tea.KeySpace:
			m.draft += string(k.Runes)
		case tea.KeyCtrlC:
			return m, tea.Quit
		}
		return m, nil
	}
	switch k.String() {
	case "q", "ctrl+c":
		return m, tea.Quit
	case "s":
		m.sort = (m.sort + 1) % numSortKeys
	case "S":
		m.sort = (m.sort + numSortKeys - 1) % numSortKeys
	case "r":
		m.asc = !m.asc
	case "x":
		m.hideExited = !m.hideExited
	case "/":
		m.editing, m.draft = true, m.filter
	case "esc", "c":
		m.filter = ""
	case "up", "k":
		m.selected = max(m.selected-1, 0)
	case "down", "j":
		m.selected++
	}
	return m, nil
}

func (m *model) View() string {
	var b strings.Builder
	up := time.Since(m.started).Truncate(time.Second)
	fmt.Fprintf(&b, "%s  %s  up %s  events %d  lost %d\n",
		titleStyle.Render("rdmatrace — memory registration, live"), m.scope, up, m.st.events, m.lastStats.Lost)
	notes := m.notes
	if m.watch != nil && len(m.tr.Attached()) > 0 {
		notes = slices.DeleteFunc(slices.Clone(notes), func(n string) bool { return n == noneYet })
	}
	fmt.Fprintf(&b, "%s\n", dimStyle.Render("probes: "+describeProbes(m.tr.Attached(), notes)))
	if m.watch != nil {
		fmt.Fprintf(&b, "%s\n", dimStyle.Render(m.watch.status()))
	}
	dir := "▼"
	if m.asc {
		dir = "▲"
	}
	filter := m.filter
	if m.editing {
		filter = m.draft + "█"
	}
	if filter == "" {
		filter = "(none)"
	}
	fmt.Fprintf(&b, "sort: %s %s   filter: %s   %s\n\n", m.sort, dir, filter,
		dimStyle.Render("[s/S] sort  [r] reverse  [/] filter  [c] clear  [x] hide exited  [↑↓] select  [q] quit"))

	rows := m.st.rows(m.sort, m.asc, m.filter, m.hideExited)
	header := fmt.Sprintf("%7s  %-15s %8s %8s %6s %8s %11s %10s %9s %9s %5s %5s %5s",
		"PID", "COMM", "REG/s", "REGS", "FAIL", "DEREGS", "REGISTERED", "LIVE", "p50", "p99", "ENL", "SHR", "PRK")
	b.WriteString(headerStyle.Render(header) + "\n")
	if len(rows) == 0 {
		b.WriteString(dimStyle.Render("  no registrations seen yet") + "\n")
	}
	m.selected = min(m.selected, max(len(rows)-1, 0))
	for i, p := range rows {
		live := humanBytes(p.Live())
		if p.releasedUnseen {
			live += "*"
		}
		comm := p.Comm
		if p.Exited {
			comm = truncate(comm, 8) + " exited"
		}
		line := fmt.Sprintf("%7d  %-15s %8.1f %8d %6d %8d %11s %10s %9s %9s %5d %5d %5d",
			p.PID, comm, p.Rate, p.Regs, p.RegFails, p.Deregs, humanBytes(p.Registered), live,
			humanDuration(p.Percentile(0.50)), humanDuration(p.Percentile(0.99)), p.Enlargements, p.Shrinks, p.Parks)
		if i == m.selected {
			line = selStyle.Render(line)
		}
		b.WriteString(line + "\n")
	}
	if len(rows) > 0 {
		p := rows[m.selected]
		sl, rl, sm := p.phases()
		fmt.Fprintf(&b, "\n%s\n", dimStyle.Render(fmt.Sprintf("connections of pid %d by phase (from enlargement markers): %d sending into large buffers, %d receiving into large buffers, %d directions left small (refused, timed out, failed)", p.PID, sl, rl, sm)))
		rdma, tcp := p.providers()
		fmt.Fprintf(&b, "%s\n", dimStyle.Render(fmt.Sprintf("connections of pid %d by provider (opened since start, still open): %d over RDMA, %d over TCP", p.PID, rdma, tcp)))
		b.WriteString(m.histogram(p))
	}
	shown := map[uint32]bool{}
	for _, p := range rows {
		shown[p.PID] = true
	}
	b.WriteString("\n" + m.enlargements(shown))
	if m.err != nil {
		b.WriteString("\n" + warnStyle.Render("tracer stopped: "+m.err.Error()) + "\n")
	}
	return b.String()
}

func (m *model) histogram(p *proc) string {
	var b strings.Builder
	n := uint64(0)
	lo, hi := -1, -1
	for i, c := range p.Hist {
		if c > 0 {
			if lo < 0 {
				lo = i
			}
			hi = i
		}
		n += c
	}
	fmt.Fprintf(&b, "%s\n", headerStyle.Render(fmt.Sprintf("registration latency, pid %d (%s): %d calls, p50 %s, p99 %s (last %d)",
		p.PID, p.Comm, n, humanDuration(p.Percentile(0.5)), humanDuration(p.Percentile(0.99)), latencyWindow)))
	if lo < 0 {
		return b.String()
	}
	var peak uint64
	for _, c := range p.Hist[lo : hi+1] {
		peak = max(peak, c)
	}
	const barWidth = 40
	for i := lo; i <= hi; i++ {
		c := p.Hist[i]
		bar := strings.Repeat("█", int((c*barWidth+peak-1)/peak))
		fmt.Fprintf(&b, "  %9s – %-9s %-*s %d\n",
			humanDuration(time.Duration(1)<<i), humanDuration(time.Duration(1)<<(i+1)), barWidth, bar, c)
	}
	return b.String()
}

// enlargements lists the recent enlargements, shrinks and parks of the
// processes shown.
func (m *model) enlargements(shown map[uint32]bool) string {
	var b strings.Builder
	b.WriteString(headerStyle.Render("recent enlargements, shrinks and parks") + "\n")
	var enl []bpf.Event
	for _, ev := range m.st.enl {
		if shown[ev.PID] {
			enl = append(enl, ev)
		}
	}
	if len(enl) == 0 {
		b.WriteString(dimStyle.Render("  none seen (rdmagrpc's conn.enlargementMarker)") + "\n")
		return b.String()
	}
	show := 8
	if m.height > 0 {
		show = max(3, min(show, m.height/4))
	}
	for i := len(enl) - 1; i >= 0 && i >= len(enl)-show; i-- {
		ev := enl[i]
		fmt.Fprintf(&b, "  %s  pid %-7d %-15s conn %#-18x %9s → %-9s took %-9s %s\n",
			ev.Time.Format("15:04:05.000"), ev.PID, ev.Comm, ev.ConnID,
			humanBytes(uint64(ev.FromSize)), humanBytes(uint64(ev.ToSize)),
			humanDuration(ev.EnlargeDuration), conn.EnlargeOutcome(ev.Outcome))
	}
	return b.String()
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// processAlive reports whether pid still runs (its /proc entry exists).
func processAlive(pid uint32) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return err == nil
}
