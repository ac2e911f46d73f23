package main

import (
	"fmt"
	"os"
	"regexp"
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
	hw         *hwRates            // the RDMA ports' error counters; nil: not shown
	refresh    func(now time.Time) // on each tick; nil: none
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
		if m.refresh != nil {
			m.refresh(now)
		}
		if m.tr != nil {
			if s, err := m.tr.Stats(); err == nil {
				m.lastStats = s
			}
		}
		m.hw.sample(now)
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

// attached is the tracer's probes (none without a tracer).
func (m *model) attached() []string {
	if m.tr == nil {
		return nil
	}
	return m.tr.Attached()
}

// viewWidth is the width every line of the view is made to fit: 80
// columns, or the terminal's when it is narrower.
const viewWidth = 80

func (m *model) cols() int {
	if m.width > 0 && m.width < viewWidth {
		return m.width
	}
	return viewWidth
}

// rowHeader and rowFormat lay out the process table in 76 columns: each
// field's formatter (shortCount, shortBytes, shortDuration) bounds its
// width.
const (
	rowHeader = "%7s %-12s %6s %5s %5s %5s %6s %5s %5s %5s %5s"
	rowFormat = "%7d %-12s %6s %5s %5s %5s %6s %5s %5s %5s %5s"
)

func tableHeader() string {
	return fmt.Sprintf(rowHeader, "PID", "COMM", "REG/s", "REGS", "FAIL", "REGD", "LIVE", "p50", "p99", "ENL", "SHR")
}

func tableRow(p *proc) string {
	live := shortBytes(p.Live())
	if p.releasedUnseen {
		live += "*"
	}
	comm := truncate(p.Comm, 12)
	if p.Exited {
		comm = truncate(p.Comm, 7) + " gone"
	}
	return fmt.Sprintf(rowFormat, p.PID, comm, shortRate(p.Rate), shortCount(p.Regs), shortCount(p.RegFails),
		shortBytes(p.Registered), live, shortDuration(p.Percentile(0.50)), shortDuration(p.Percentile(0.99)),
		shortCount(p.Enlargements), shortCount(p.Shrinks))
}

// eventLine is one enlargement, shrink or park of the recent list, in 80
// columns for connection ids up to 6 digits (longer ones are cut by fit).
func eventLine(ev bpf.Event) string {
	what := fmt.Sprintf("%s→%s %s", shortBytes(uint64(ev.FromSize)), shortBytes(uint64(ev.ToSize)), shortDuration(ev.EnlargeDuration))
	return fmt.Sprintf(eventFormat, ev.Time.Format("15:04:05"), fmt.Sprint(ev.PID), truncate(ev.Comm, 9),
		strings.TrimPrefix(conn.ConnName(ev.ConnID), "conn "), what, conn.EnlargeOutcome(ev.Outcome))
}

const eventFormat = "%-8s %7s %-9s %6s %-17s %s"

func (m *model) View() string {
	w := m.cols()
	var b strings.Builder
	line := func(s string) { b.WriteString(fit(s, w) + "\n") }
	prose := func(style lipgloss.Style, s string) {
		for _, l := range wrap(s, w) {
			b.WriteString(style.Render(l) + "\n")
		}
	}
	up := time.Since(m.started).Truncate(time.Second)
	line(titleStyle.Render("rdmatrace") + fmt.Sprintf("  %s  up %s  events %d  lost %d", m.scope, up, m.st.events, m.lastStats.Lost))
	notes := m.notes
	attached := m.attached()
	if m.watch != nil && len(attached) > 0 {
		notes = slices.DeleteFunc(slices.Clone(notes), func(n string) bool { return n == noneYet })
	}
	prose(dimStyle, "probes: "+describeProbes(attached, notes))
	if m.watch != nil {
		prose(dimStyle, m.watch.status())
	}
	if m.hw != nil {
		for _, l := range m.hw.lines() {
			prose(lipgloss.NewStyle(), l)
		}
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
	line(fmt.Sprintf("sort: %s %s  filter: %s  ", m.sort, dir, truncate(filter, 20)) +
		dimStyle.Render("s/S sort r rev / filter c clear x exited ↑↓ q"))
	b.WriteString("\n")

	rows := m.st.rows(m.sort, m.asc, m.filter, m.hideExited)
	line(headerStyle.Render(tableHeader()))
	if len(rows) == 0 {
		line(dimStyle.Render("  no registrations seen yet"))
	}
	m.selected = min(m.selected, max(len(rows)-1, 0))
	for i, p := range rows {
		r := fit(tableRow(p), w)
		if i == m.selected {
			r = selStyle.Render(r)
		}
		b.WriteString(r + "\n")
	}
	if len(rows) > 0 {
		p := rows[m.selected]
		sl, rl, sm := p.phases()
		b.WriteString("\n")
		prose(dimStyle, fmt.Sprintf("pid %d connections: %s; by phase: %d sending large, %d receiving large, %d directions small; %d parks",
			p.PID, p.connCounts(), sl, rl, sm, p.Parks))
		if p.Partial {
			prose(dimStyle, "≥: this process ran before rdmatrace; connections it opened earlier are counted only as far as its sockets show (rdmatrace conns)")
		}
		b.WriteString(m.histogram(p, w))
	}
	shown := map[uint32]bool{}
	for _, p := range rows {
		shown[p.PID] = true
	}
	b.WriteString("\n" + m.enlargements(shown, w))
	if m.err != nil {
		prose(warnStyle, "tracer stopped: "+m.err.Error())
	}
	return b.String()
}

func (m *model) histogram(p *proc, w int) string {
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
	b.WriteString(fit(headerStyle.Render(fmt.Sprintf("registration latency, pid %d (%s): %d calls, p50 %s, p99 %s",
		p.PID, truncate(p.Comm, 15), n, shortDuration(p.Percentile(0.5)), shortDuration(p.Percentile(0.99)))), w) + "\n")
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
		b.WriteString(fit(fmt.Sprintf("  %6s – %-6s %-*s %s",
			shortDuration(time.Duration(1)<<i), shortDuration(time.Duration(1)<<(i+1)), barWidth, bar, shortCount(c)), w) + "\n")
	}
	return b.String()
}

// enlargements lists the recent enlargements, shrinks and parks of the
// processes shown.
func (m *model) enlargements(shown map[uint32]bool, w int) string {
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
	b.WriteString(fit(dimStyle.Render(fmt.Sprintf(eventFormat, "TIME", "PID", "COMM", "CONN", "SIZES, TOOK", "OUTCOME")), w) + "\n")
	for i := len(enl) - 1; i >= 0 && i >= len(enl)-show; i-- {
		b.WriteString(fit(eventLine(enl[i]), w) + "\n")
	}
	return b.String()
}

// fit cuts s (which may hold escape codes) to w columns, marking a cut
// with "…".
func fit(s string, w int) string {
	if lipgloss.Width(s) <= w {
		return s
	}
	plain := ansiRE.ReplaceAllString(s, "")
	r := []rune(plain)
	for lipgloss.Width(string(r)) > w-1 {
		r = r[:len(r)-1]
	}
	return string(r) + "…"
}

var ansiRE = regexp.MustCompile("\x1b\\[[0-9;]*[a-zA-Z]")

// wrap breaks s at spaces into lines of at most w columns (a word longer
// than w is cut by fit).
func wrap(s string, w int) []string {
	var out []string
	cur := ""
	for _, word := range strings.Fields(s) {
		switch {
		case cur == "":
			cur = word
		case lipgloss.Width(cur)+1+lipgloss.Width(word) <= w:
			cur += " " + word
		default:
			out = append(out, fit(cur, w))
			cur = "  " + word
		}
	}
	if cur != "" {
		out = append(out, fit(cur, w))
	}
	return out
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
