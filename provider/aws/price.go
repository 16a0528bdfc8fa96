package aws

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/aws-sdk-go-v2/service/pricing"
	pricingtypes "github.com/aws/aws-sdk-go-v2/service/pricing/types"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// PricingAPI is what the provider calls of the Price List Query API
// (*pricing.Client).
type PricingAPI interface {
	GetProducts(context.Context, *pricing.GetProductsInput, ...func(*pricing.Options)) (*pricing.GetProductsOutput, error)
}

// Where the prices come from, as a record's price names it.
const (
	SourceOnDemand = "aws price list"
	SourceSpot     = "aws spot price history"
)

// PricingRegion is the region of the Price List Query API endpoint a
// pool's manager asks: the API has endpoints in us-east-1, eu-central-1
// and ap-south-1 only ("Using the AWS Price List Query API", Billing user
// guide), each serving every region's prices, and the China regions'
// in cn-northwest-1; the nearest is taken.
func PricingRegion(region string) string {
	switch {
	case strings.HasPrefix(region, "cn-"):
		return "cn-northwest-1"
	case strings.HasPrefix(region, "eu-"):
		return "eu-central-1"
	case strings.HasPrefix(region, "ap-"):
		return "ap-south-1"
	}
	return "us-east-1"
}

// Price is what an instance costs by the hour: a Spot instance at the
// Spot price in effect in its zone at that moment (EC2's Spot price
// history: the price billed then), an on-demand one at the price list's
// on-demand price for Linux on shared tenancy in the pool's region.
func (p *Provider) Price(ctx context.Context, m record.Machine, at time.Time) (record.Price, error) {
	if m.InstanceType == "" {
		return record.Price{}, fmt.Errorf("aws price: no instance type: %w", provider.ErrNotPriced)
	}
	if m.Spot {
		return p.spotPrice(ctx, m, at)
	}
	return p.onDemandPrice(ctx, m.InstanceType)
}

// spotPrice reads DescribeSpotPriceHistory for the moment: with StartTime
// and EndTime both at it, EC2 answers the price in effect then, one for
// each zone (EC2 API reference, DescribeSpotPriceHistory: "the last price
// change before the start time, which is the effective price as of the
// start time").
func (p *Provider) spotPrice(ctx context.Context, m record.Machine, at time.Time) (record.Price, error) {
	in := &ec2.DescribeSpotPriceHistoryInput{
		InstanceTypes:       []types.InstanceType{types.InstanceType(m.InstanceType)},
		ProductDescriptions: []string{"Linux/UNIX"},
		StartTime:           awssdk.Time(at),
		EndTime:             awssdk.Time(at),
	}
	if m.Zone != "" {
		in.AvailabilityZone = awssdk.String(m.Zone)
	}
	out, err := p.opt.API.DescribeSpotPriceHistory(ctx, in)
	if err != nil {
		return record.Price{}, priceError("DescribeSpotPriceHistory", err)
	}
	for _, h := range out.SpotPriceHistory {
		if m.Zone != "" && awssdk.ToString(h.AvailabilityZone) != m.Zone {
			continue
		}
		v, err := strconv.ParseFloat(awssdk.ToString(h.SpotPrice), 64)
		if err != nil || v <= 0 {
			return record.Price{}, fmt.Errorf("aws spot price history: %q for %s is no price: %w", awssdk.ToString(h.SpotPrice), m.InstanceType, provider.ErrNotPriced)
		}
		return record.Price{PerHour: v, Currency: "USD", Source: SourceSpot}, nil
	}
	return record.Price{}, fmt.Errorf("aws spot price history: no Linux/UNIX price for %s in %s at %s: %w", m.InstanceType, m.Zone, at.UTC().Format(time.RFC3339), provider.ErrNotPriced)
}

// onDemandPrice reads the price list's product for the type: Linux, no
// software, shared tenancy, capacity used (not a reservation), as AWS's
// own examples of GetProducts filter it.
func (p *Provider) onDemandPrice(ctx context.Context, typ string) (record.Price, error) {
	if p.opt.Pricing == nil {
		return record.Price{}, fmt.Errorf("aws price list: no client: %w", provider.ErrNotPriced)
	}
	match := func(field, value string) pricingtypes.Filter {
		return pricingtypes.Filter{Type: pricingtypes.FilterTypeTermMatch, Field: awssdk.String(field), Value: awssdk.String(value)}
	}
	out, err := p.opt.Pricing.GetProducts(ctx, &pricing.GetProductsInput{
		ServiceCode: awssdk.String("AmazonEC2"),
		Filters: []pricingtypes.Filter{
			match("instanceType", typ), match("regionCode", p.opt.Region), match("operatingSystem", "Linux"),
			match("tenancy", "Shared"), match("preInstalledSw", "NA"), match("capacitystatus", "Used"),
			match("licenseModel", "No License required"),
		},
		MaxResults: awssdk.Int32(10),
	})
	if err != nil {
		return record.Price{}, priceError("GetProducts", err)
	}
	for _, doc := range out.PriceList {
		if pr, ok := onDemandOf(doc); ok {
			return pr, nil
		}
	}
	return record.Price{}, fmt.Errorf("aws price list: no on-demand Linux price for %s in %s: %w", typ, p.opt.Region, provider.ErrNotPriced)
}

// product is the part of a price list document read here: its on-demand
// terms, each with its price dimensions ("Understanding the price list
// file", Billing user guide: terms.OnDemand.<offer>.priceDimensions.<rate>
// with unit and pricePerUnit by currency).
type product struct {
	Terms struct {
		OnDemand map[string]struct {
			PriceDimensions map[string]struct {
				Unit         string            `json:"unit"`
				PricePerUnit map[string]string `json:"pricePerUnit"`
			} `json:"priceDimensions"`
		} `json:"OnDemand"`
	} `json:"terms"`
}

// onDemandOf is a document's on-demand price by the hour, in US dollars,
// or in the one currency it gives (yuan, in the China regions).
func onDemandOf(doc string) (record.Price, bool) {
	var pr product
	if err := json.Unmarshal([]byte(doc), &pr); err != nil {
		return record.Price{}, false
	}
	for _, term := range pr.Terms.OnDemand {
		for _, d := range term.PriceDimensions {
			if d.Unit != "Hrs" {
				continue
			}
			for _, cur := range []string{"USD", "CNY"} {
				if s, ok := d.PricePerUnit[cur]; ok {
					if v, err := strconv.ParseFloat(s, 64); err == nil && v > 0 {
						return record.Price{PerHour: v, Currency: cur, Source: SourceOnDemand}, true
					}
				}
			}
		}
	}
	return record.Price{}, false
}

// priceError wraps a price call's error: one that asking again does not
// fix (no permission, a parameter refused, nothing found) as such.
func priceError(op string, err error) error {
	switch c := code(err); c {
	case "AccessDeniedException", "UnauthorizedOperation", "AuthFailure":
		return fmt.Errorf("aws %s: %w", op, provider.Rejected(err))
	case "InvalidParameterException", "InvalidParameterValue", "NotFoundException":
		return fmt.Errorf("aws %s: %w: %w", op, provider.ErrNotPriced, err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("aws %s: timed out: %w", op, err)
	}
	return fmt.Errorf("aws %s: %w", op, err)
}
