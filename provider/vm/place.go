package vm

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/runfleet/runfleet/provider"
)

// Outcome is what a cloud's answer to one placement means.
type Outcome int

const (
	// Transient: not known to have failed for good; the pool backs off.
	Transient Outcome = iota
	// NoCapacity: this type, place or market has none, or its quota is
	// spent: the next is tried.
	NoCapacity
	// Refused: no retry fixes it here (a type not offered, a permission
	// missing): the next is tried, and the pool halts only if all
	// refuse.
	Refused
	// Throttled: the cloud's request rate is spent: the pool backs off.
	Throttled
	// Halt: no choice would take it (no permission, no such image): the
	// pool halts at once, saying why.
	Halt
)

// Placement is the choices a runner's machine is tried at, in order:
// each market (Spot first when asked for, then standard when the
// fallback says so), each machine type, each place (zone, location).
type Placement struct {
	Spot, Fallback bool
	Types, Places  []string
	// What names the call in errors ("insert instance"); Standard the
	// cloud's word for a machine that is not Spot ("standard",
	// "regular"); Limit names its request limits ("Compute Engine's
	// request quota").
	What, Standard, Limit string
	// AnyType and AnyPlace name an empty type or place in errors ("the
	// template's type", "the default subnet"): the cloud's own choice.
	AnyType, AnyPlace string
	// Judge says what an error means, with its code and a line for
	// the refusals' summary.
	Judge  func(error) (o Outcome, code, line string)
	Logger *slog.Logger
}

// Try calls try for each choice until one succeeds. It returns nil then;
// an error naming every choice's answer when none has capacity; one
// wrapping provider.ErrRejected when all refused; the error of the first
// transient failure or throttling.
func (pl Placement) Try(runner string, try func(spot bool, typ, place string) error) error {
	markets := []bool{pl.Spot}
	if pl.Spot && pl.Fallback {
		markets = append(markets, false)
	}
	var tried, refused []string
	for _, spot := range markets {
		for _, typ := range pl.Types {
			for _, place := range pl.Places {
				err := try(spot, typ, place)
				if err == nil {
					return nil
				}
				o, code, line := pl.judge(err)
				switch o {
				case NoCapacity:
					tried = append(tried, fmt.Sprintf("%s %s in %s: %s", pl.market(spot), or(typ, pl.AnyType), or(place, pl.AnyPlace), code))
					pl.Logger.Info("no capacity; trying the next", "runner", runner, "type", typ, "place", place, "market", pl.market(spot), "code", code)
					continue
				case Refused:
					refused = append(refused, fmt.Sprintf("%s in %s: %s", or(typ, pl.AnyType), or(place, pl.AnyPlace), line))
					continue
				case Throttled:
					return fmt.Errorf("%s: %s is spent (%s); the pool backs off: %w", pl.What, pl.Limit, code, err)
				case Halt:
					if errors.Is(err, provider.ErrRejected) {
						return err
					}
					return fmt.Errorf("%w: %s: %w", provider.ErrRejected, pl.What, err)
				}
				return fmt.Errorf("%s: %w", pl.What, err)
			}
		}
	}
	if len(tried) == 0 && len(refused) > 0 {
		return fmt.Errorf("%w: %s: %s", provider.ErrRejected, pl.What, strings.Join(refused, "; "))
	}
	why := "no capacity: " + strings.Join(append(tried, refused...), "; ")
	if pl.Spot && !pl.Fallback {
		why += " (spot_fallback: on_demand would fall back to " + pl.Standard + " machines)"
	}
	return errors.New(why)
}

// judge is Judge, but for a batch that made fewer than it asked for:
// the rest are asked of the next choice.
func (pl Placement) judge(err error) (Outcome, string, string) {
	if f := (*fewer)(nil); errors.As(err, &f) {
		return NoCapacity, f.Error(), ""
	}
	return pl.Judge(err)
}

// fewer is a launch of several machines that made fewer than it asked
// for (EC2's MinCount, Compute Engine's minCount): Try asks the next
// choice for the rest.
type fewer struct{ made, asked int }

func (f *fewer) Error() string { return fmt.Sprintf("%d of %d", f.made, f.asked) }

// market names a market as the cloud does.
func (pl Placement) market(spot bool) string {
	if spot {
		return "spot"
	}
	return pl.Standard
}

// TryBoot is Try for a runner whose boot data (made by boot) names where
// its machine was placed, when the runner keeps a record (spec.Record):
// the boot data is made again at each choice, the record's image, type,
// place and market set first (Placed). Boot data that cannot be made is
// refused: no choice would take it.
func TryBoot[B any](pl Placement, spec provider.Spec, image string, boot func() (B, error), try func(spot bool, typ, place string, boot B) error) error {
	b, err := boot()
	if err != nil {
		return provider.Rejected(err)
	}
	return pl.Try(spec.Name, func(spot bool, typ, place string) error {
		if spec.Record != nil {
			Placed(spec, image, typ, place, spot)
			if b, err = boot(); err != nil {
				return provider.Rejected(err)
			}
		}
		return try(spot, typ, place, b)
	})
}
