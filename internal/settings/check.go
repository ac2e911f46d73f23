package settings

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
)

// Problem is what Check found wrong with one variable.
type Problem struct {
	Name, Value string
	// Warning: a name the library does not know (a misspelling is
	// ignored otherwise); else a bad value, an error.
	Warning bool
	Err     error
}

func (p Problem) String() string { return p.Err.Error() }

// Check looks at every RDMAGRPC_* variable of environ (os.Environ when
// nil): an error for each library setting whose value is bad, a warning
// for each name that is neither a setting nor one of Tools, with the
// setting it was probably meant to be. Empty values count as unset.
func Check(environ []string) []Problem {
	if environ == nil {
		environ = os.Environ()
	}
	var ps []Problem
	for _, kv := range environ {
		name, value, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(strings.ToUpper(name), prefix) || IsTool(name) {
			continue
		}
		v, ok := Lookup(name)
		if !ok {
			msg := fmt.Sprintf("%s is not an rdmagrpc setting, ignored", name)
			if m := Suggest(name); m != "" {
				msg += "; did you mean " + m + "?"
			}
			ps = append(ps, Problem{Name: name, Value: value, Warning: true, Err: errors.New(msg)})
			continue
		}
		if strings.TrimSpace(value) == "" {
			continue
		}
		if err := v.check(value); err != nil {
			ps = append(ps, Problem{Name: name, Value: value, Err: err})
		}
	}
	slices.SortStableFunc(ps, func(a, b Problem) int { return strings.Compare(a.Name, b.Name) })
	return ps
}

// Err joins the errors among ps (not the warnings): nil when there is
// none; else it is a transport.ErrBadSetting.
func Err(ps []Problem) error {
	var errs []error
	for _, p := range ps {
		if !p.Warning {
			errs = append(errs, p.Err)
		}
	}
	return errors.Join(errs...)
}

// Suggest returns the library setting name is probably a misspelling of,
// or "": one a few edits away, the same but for case, or one whose end
// it is (RDMAGRPC_TC for RDMAGRPC_VERBS_TC).
func Suggest(name string) string {
	u := strings.ToUpper(name)
	rest := strings.TrimPrefix(u, prefix)
	if rest != "" {
		for _, v := range Vars {
			if strings.HasSuffix(v.Name, "_"+rest) {
				return v.Name
			}
		}
	}
	best, bestD := "", min(3, max(1, len(rest)/3))+1
	for _, v := range Vars {
		if d := distance(u, v.Name); d < bestD {
			best, bestD = v.Name, d
		}
	}
	return best
}

// distance is the Levenshtein distance of a and b.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
