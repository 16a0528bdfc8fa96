package aws_test

import (
	"errors"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/aws"
	"github.com/runfleet/runfleet/record"
)

// TestPriceFromTheLists: an on-demand instance is priced from the price
// list's product for Linux on shared tenancy (the stand-in lists Windows,
// dedicated, SQL Server and reservation products of the type beside it),
// a Spot one at the Spot price its zone had when it was made, before and
// after a change.
func TestPriceFromTheLists(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [g5.xlarge]\n")
	ctx := t.Context()
	pr, err := p.Price(ctx, record.Machine{InstanceType: "g5.xlarge", Zone: "us-east-1b"}, time.Now())
	if err != nil || pr.PerHour != ec2sim.OnDemandPrices["g5.xlarge"] || pr.Currency != "USD" || pr.Source != aws.SourceOnDemand {
		t.Errorf("on demand: %+v, %v; want %v USD from %q", pr, err, ec2sim.OnDemandPrices["g5.xlarge"], aws.SourceOnDemand)
	}
	if sim.PricingCalls() != 1 {
		t.Errorf("%d price list calls, want 1", sim.PricingCalls())
	}

	before := time.Now()
	time.Sleep(10 * time.Millisecond)
	sim.SetSpotPrice("g5.xlarge", 0.4523)
	after := time.Now().Add(time.Second)
	spot := record.Machine{InstanceType: "g5.xlarge", Zone: "us-east-1a", Spot: true}
	if pr, err := p.Price(ctx, spot, before); err != nil || pr.PerHour != ec2sim.DefaultSpotPrice || pr.Source != aws.SourceSpot {
		t.Errorf("Spot before the change: %+v, %v; want %v", pr, err, ec2sim.DefaultSpotPrice)
	}
	if pr, err := p.Price(ctx, spot, after); err != nil || pr.PerHour != 0.4523 {
		t.Errorf("Spot after the change: %+v, %v; want 0.4523", pr, err)
	}
}

// TestPriceErrors: a type the list has not, and a manager whose identity
// may not read the list, are errors that asking again does not fix; an
// outage of the list is one it may.
func TestPriceErrors(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\n")
	ctx := t.Context()
	if _, err := p.Price(ctx, record.Machine{InstanceType: "m6i.large", Zone: "us-east-1a"}, time.Now()); !errors.Is(err, provider.ErrNotPriced) {
		t.Errorf("a type not listed: %v, want ErrNotPriced", err)
	}
	sim.DenyPricing(true)
	if _, err := p.Price(ctx, record.Machine{InstanceType: "t3.medium", Zone: "us-east-1a"}, time.Now()); !errors.Is(err, provider.ErrRejected) {
		t.Errorf("without pricing:GetProducts: %v, want ErrRejected", err)
	}
	sim.DenyPricing(false)
	sim.SetPricingDown(true)
	_, err := p.Price(ctx, record.Machine{InstanceType: "t3.medium", Zone: "us-east-1a"}, time.Now())
	if err == nil || errors.Is(err, provider.ErrRejected) || errors.Is(err, provider.ErrNotPriced) {
		t.Errorf("the list down: %v, want an error to try again", err)
	}
}
