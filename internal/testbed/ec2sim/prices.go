package ec2sim

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// What EC2 instances cost, as AWS publishes it: the Spot price history of
// the EC2 Query API (DescribeSpotPriceHistory, EC2 API reference), and
// the on-demand prices of the Price List Query API (GetProducts, AWS
// Price List Service API reference; the documents' layout from the
// Billing user guide's "Understanding the price list file"), which is a
// service of its own, on its own endpoint (PricingURL), speaking AWS JSON
// 1.1 (X-Amz-Target: AWSPriceListService.GetProducts).

// OnDemandPrices are the stand-in's on-demand prices (USD an hour, Linux,
// shared tenancy) in us-east-1, AWS's published ones for the types it
// runs (aws.amazon.com/ec2/pricing/on-demand). A type not here has no
// product in the price list.
var OnDemandPrices = map[string]float64{
	"t3.micro": 0.0104, "t3.small": 0.0208, "t3.medium": 0.0416, "t3.large": 0.0832,
	"m5.large": 0.096, "m5.xlarge": 0.192, "m5.2xlarge": 0.384, "c5.large": 0.085, "c5.xlarge": 0.17,
	"g4dn.xlarge": 0.526, "g4dn.2xlarge": 0.752, "g4dn.12xlarge": 3.912,
	"g5.xlarge": 1.006, "g5.2xlarge": 1.212, "g5.12xlarge": 5.672,
	"g6.xlarge": 0.8048, "p3.2xlarge": 3.06, "p3.8xlarge": 12.24, "p5.48xlarge": 55.04,
}

// pricingRegion is the one region the stand-in's price list covers.
const pricingRegion = "us-east-1"

// spotPoint is a Spot price change.
type spotPoint struct {
	at    time.Time
	price float64
}

// spotHistory is when each type's Spot price changed: DefaultSpotPrice
// from the server's start, then each SetSpotPrice. Called with s.mu held.
func (s *Server) spotHistory(typ string) []spotPoint {
	h := s.spotChanges[typ]
	if len(h) == 0 || !h[0].at.Equal(s.started) {
		h = append([]spotPoint{{s.started, DefaultSpotPrice}}, h...)
	}
	return h
}

type spotHistoryResponse struct {
	XMLName   xml.Name         `xml:"DescribeSpotPriceHistoryResponse"`
	RequestID string           `xml:"requestId"`
	Items     []spotHistoryXML `xml:"spotPriceHistorySet>item"`
	NextToken string           `xml:"nextToken,omitempty"`
}

type spotHistoryXML struct {
	Type        string `xml:"instanceType"`
	Description string `xml:"productDescription"`
	Price       string `xml:"spotPrice"`
	Timestamp   string `xml:"timestamp"`
	Zone        string `xml:"availabilityZone"`
}

// describeSpotPriceHistory answers DescribeSpotPriceHistory: for each
// type (InstanceType.N; every type it describes without), zone
// (AvailabilityZone; every zone of its subnets without) and product
// (ProductDescription.N; Linux/UNIX is the only one it prices), the
// price changes within [StartTime, EndTime] and the last one before
// StartTime, which was in effect then (the reference's words); newest
// first. No StartTime is now, and a StartTime after EndTime is refused.
// Called with s.mu held.
func (s *Server) describeSpotPriceHistory(form url.Values) (any, *apiError) {
	now := time.Now()
	start, end := now, now
	for _, p := range []struct {
		name string
		t    *time.Time
	}{{"StartTime", &start}, {"EndTime", &end}} {
		if v := form.Get(p.name); v != "" {
			t, err := time.Parse(time.RFC3339, v)
			if err != nil {
				return nil, badParam("Invalid value '%s' for %s", v, p.name)
			}
			*p.t = t
		}
	}
	if start.After(end) {
		return nil, badParam("The start time %s is after the end time %s", start.Format(time.RFC3339), end.Format(time.RFC3339))
	}
	types := list(form, "InstanceType")
	if len(types) == 0 {
		types = slices.Sorted(maps.Keys(typeInfos))
	}
	var zones []string
	if z := form.Get("AvailabilityZone"); z != "" {
		zones = []string{z}
	} else {
		for _, z := range s.subnets {
			zones = append(zones, z)
		}
		slices.Sort(zones)
		zones = slices.Compact(zones)
	}
	descs := list(form, "ProductDescription")
	if len(descs) > 0 && !slices.Contains(descs, "Linux/UNIX") {
		return spotHistoryResponse{RequestID: requestID()}, nil
	}
	out := spotHistoryResponse{RequestID: requestID()}
	for _, typ := range types {
		if !knownTypes.MatchString(typ) {
			continue
		}
		h := s.spotHistory(typ)
		for i := len(h) - 1; i >= 0; i-- {
			p := h[i]
			if p.at.After(end) {
				continue
			}
			for _, z := range zones {
				out.Items = append(out.Items, spotHistoryXML{
					Type: typ, Description: "Linux/UNIX", Price: strconv.FormatFloat(p.price, 'f', 6, 64),
					Timestamp: p.at.UTC().Format("2006-01-02T15:04:05.000Z"), Zone: z,
				})
			}
			if !p.at.After(start) {
				break // the one in effect at the start
			}
		}
	}
	return out, nil
}

// pricingState is the Price List Query API's side.
type pricingState struct {
	mu     sync.Mutex
	srv    *http.Server
	url    string
	calls  int
	denied bool // every call AccessDeniedException: no pricing:GetProducts
	down   bool
}

func (s *Server) startPricing() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	s.pricing = &pricingState{url: "http://" + ln.Addr().String()}
	s.pricing.srv = &http.Server{Handler: http.HandlerFunc(s.servePricing), ReadHeaderTimeout: 10 * time.Second}
	go s.pricing.srv.Serve(ln)
	return nil
}

// PricingURL is where the Price List Query API stand-in answers.
func (s *Server) PricingURL() string { return s.pricing.url }

// PricingCalls is how many GetProducts calls it got.
func (s *Server) PricingCalls() int {
	s.pricing.mu.Lock()
	defer s.pricing.mu.Unlock()
	return s.pricing.calls
}

// DenyPricing makes every price list call fail as it does for an
// identity without pricing:GetProducts, or allows them again.
func (s *Server) DenyPricing(denied bool) {
	s.pricing.mu.Lock()
	defer s.pricing.mu.Unlock()
	s.pricing.denied = denied
}

// SetPricingDown makes the price list answer 500 InternalErrorException,
// or brings it back.
func (s *Server) SetPricingDown(down bool) {
	s.pricing.mu.Lock()
	defer s.pricing.mu.Unlock()
	s.pricing.down = down
}

func writeJSONError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/x-amz-json-1.1")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"__type": code, "message": msg})
}

// servePricing answers GetProducts: the products of ServiceCode AmazonEC2
// whose attributes match every TERM_MATCH filter (an unknown field
// matches nothing), in pages of MaxResults (1 to 100, 100 by default).
// The answer's PriceList holds each product as a JSON document in a
// string, as the API's does.
func (s *Server) servePricing(w http.ResponseWriter, r *http.Request) {
	st := s.pricing
	action, ok := strings.CutPrefix(r.Header.Get("X-Amz-Target"), "AWSPriceListService.")
	if r.Method != http.MethodPost || !ok {
		writeJSONError(w, http.StatusBadRequest, "UnknownOperationException", "")
		return
	}
	if !strings.HasPrefix(r.Header.Get("Authorization"), "AWS4-HMAC-SHA256 Credential="+AccessKey+"/") {
		writeJSONError(w, http.StatusBadRequest, "UnrecognizedClientException", "The security token included in the request is invalid.")
		return
	}
	st.mu.Lock()
	st.calls++
	denied, down := st.denied, st.down
	st.mu.Unlock()
	switch {
	case action != "GetProducts":
		writeJSONError(w, http.StatusBadRequest, "UnknownOperationException", "")
		return
	case denied:
		writeJSONError(w, http.StatusBadRequest, "AccessDeniedException", "User is not authorized to perform: pricing:GetProducts")
		return
	case down:
		writeJSONError(w, http.StatusInternalServerError, "InternalErrorException", "An internal error occurred.")
		return
	}
	var in struct {
		ServiceCode string
		Filters     []struct{ Type, Field, Value string }
		MaxResults  int
		NextToken   string
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10)).Decode(&in); err != nil {
		writeJSONError(w, http.StatusBadRequest, "SerializationException", err.Error())
		return
	}
	if in.ServiceCode == "" {
		writeJSONError(w, http.StatusBadRequest, "InvalidParameterException", "Input parameters ServiceCode is required")
		return
	}
	if in.MaxResults == 0 {
		in.MaxResults = 100
	}
	if in.MaxResults < 1 || in.MaxResults > 100 {
		writeJSONError(w, http.StatusBadRequest, "InvalidParameterException", fmt.Sprintf("MaxResults %d is not within 1 and 100", in.MaxResults))
		return
	}
	var docs []string
	for _, p := range ec2Products(in.ServiceCode) {
		match := true
		for _, f := range in.Filters {
			if f.Type != "TERM_MATCH" || p.attrs[f.Field] != f.Value {
				match = false
				break
			}
		}
		if match {
			docs = append(docs, p.doc())
		}
	}
	start := 0
	if in.NextToken != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(in.NextToken, "pricing-"))
		if err != nil || n < 0 || n > len(docs) {
			writeJSONError(w, http.StatusBadRequest, "InvalidNextTokenException", "The NextToken is invalid.")
			return
		}
		start = n
	}
	out := map[string]any{"FormatVersion": "aws_v1", "PriceList": docs[start:min(start+in.MaxResults, len(docs))]}
	if start+in.MaxResults < len(docs) {
		out["NextToken"] = "pricing-" + strconv.Itoa(start+in.MaxResults)
	}
	w.Header().Set("Content-Type", "application/x-amz-json-1.1")
	_ = json.NewEncoder(w).Encode(out)
}

// ec2Product is one product of the price list: its attributes and its
// on-demand price by the hour.
type ec2Product struct {
	sku   string
	attrs map[string]string
	price float64
}

// ec2Products are the stand-in's products: for each type priced, the
// Linux one on shared tenancy that a runner's instance is, and beside it
// the variants the same type has in AWS's list, each priced apart:
// Windows, dedicated tenancy, SQL Server preinstalled, and an unused
// capacity reservation. A query missing a filter gets several, not the
// one it meant, first. Other services have none.
func ec2Products(service string) []ec2Product {
	if service != "AmazonEC2" {
		return nil
	}
	var out []ec2Product
	for _, typ := range slices.Sorted(maps.Keys(OnDemandPrices)) {
		price := OnDemandPrices[typ]
		base := map[string]string{
			"servicecode": "AmazonEC2", "instanceType": typ, "regionCode": pricingRegion, "location": "US East (N. Virginia)",
			"operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used",
			"licenseModel": "No License required", "marketoption": "OnDemand",
		}
		variant := func(n int, price float64, change ...string) ec2Product {
			a := map[string]string{}
			for k, v := range base {
				a[k] = v
			}
			for i := 0; i+1 < len(change); i += 2 {
				a[change[i]] = change[i+1]
			}
			return ec2Product{sku: fmt.Sprintf("SIM%s%d", strings.ToUpper(strings.ReplaceAll(typ, ".", "")), n), attrs: a, price: price}
		}
		out = append(out,
			variant(1, price+0.046, "operatingSystem", "Windows", "licenseModel", "License included"),
			variant(2, price*1.1, "tenancy", "Dedicated"),
			variant(3, price+0.12, "preInstalledSw", "SQL Web"),
			variant(4, price, "capacitystatus", "UnusedCapacityReservation"),
			variant(5, price),
		)
	}
	return out
}

// doc is the product as the price list gives it: a JSON document with its
// product, its attributes and its on-demand terms (and reserved ones,
// which a reader of on-demand prices must pass over).
func (p ec2Product) doc() string {
	term := p.sku + ".JRTCKXETXF"
	d := map[string]any{
		"product":     map[string]any{"productFamily": "Compute Instance", "attributes": p.attrs, "sku": p.sku},
		"serviceCode": "AmazonEC2",
		"terms": map[string]any{
			"OnDemand": map[string]any{term: map[string]any{
				"priceDimensions": map[string]any{term + ".6YS6EN2CT7": map[string]any{
					"unit": "Hrs", "endRange": "Inf", "beginRange": "0",
					"description":  fmt.Sprintf("$%.4f per On Demand %s %s Instance Hour", p.price, p.attrs["operatingSystem"], p.attrs["instanceType"]),
					"pricePerUnit": map[string]string{"USD": strconv.FormatFloat(p.price, 'f', 10, 64)},
				}},
				"sku": p.sku, "effectiveDate": "2026-11-01T00:00:00Z", "offerTermCode": "JRTCKXETXF",
			}},
			"Reserved": map[string]any{p.sku + ".4NA7Y494T4": map[string]any{
				"priceDimensions": map[string]any{p.sku + ".4NA7Y494T4.2TG2D8R56U": map[string]any{
					"unit": "Quantity", "pricePerUnit": map[string]string{"USD": "1000"}, "description": "Upfront Fee",
				}},
			}},
		},
		"version": "20261101000000", "publicationDate": "2026-11-01T00:00:00Z",
	}
	b, _ := json.Marshal(d)
	return string(b)
}
