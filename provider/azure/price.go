package azure

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
)

// DefaultRetailPricesURL is the Azure Retail Prices API
// (learn.microsoft.com/rest/api/cost-management/retail-prices/azure-retail-prices):
// unauthenticated, read by no SDK, so this client is hand-written.
const DefaultRetailPricesURL = "https://prices.azure.com/api/retail/prices"

// SourceRetail is where a VM's price comes from, as its record names it.
const SourceRetail = "azure retail prices"

// maxPricePages bounds the pages one question follows: a size in a
// region has a few dozen meters at most.
const maxPricePages = 5

// RetailPrices reads VM sizes' prices from the Retail Prices API.
type RetailPrices struct {
	URL    string // DefaultRetailPricesURL, or a stand-in
	Client *http.Client
}

// retailPage is a page of the API's answer.
type retailPage struct {
	Items []struct {
		CurrencyCode  string  `json:"currencyCode"`
		RetailPrice   float64 `json:"retailPrice"`
		ArmRegionName string  `json:"armRegionName"`
		ArmSkuName    string  `json:"armSkuName"`
		SkuName       string  `json:"skuName"`
		ProductName   string  `json:"productName"`
		ServiceName   string  `json:"serviceName"`
		Type          string  `json:"type"`
		UnitOfMeasure string  `json:"unitOfMeasure"`
	} `json:"Items"`
	NextPageLink string `json:"NextPageLink"`
}

// Price is a VM's pay-as-you-go price by the hour in its location: the
// Linux meter of its size (a size's Windows meters are products of their
// own, "... Series Windows"), its Spot meter ("<size> Spot") for a Spot
// VM; Low Priority meters (Batch's) are never a VM's. Prices are US
// dollars, Microsoft's retail ones (other currencies are estimates, the
// API's page says). A Spot VM is billed at the Spot price of the moment,
// which the API gives only as now: at is not read.
func (p *Provider) Price(ctx context.Context, m record.Machine, _ time.Time) (record.Price, error) {
	rp := p.opt.Prices
	if rp == nil {
		return record.Price{}, fmt.Errorf("azure retail prices: not read for this pool: %w", provider.ErrNotPriced)
	}
	if m.InstanceType == "" || m.Zone == "" {
		return record.Price{}, fmt.Errorf("azure retail prices: no size or location: %w", provider.ErrNotPriced)
	}
	q := url.Values{}
	q.Set("api-version", "2023-01-01-preview")
	// Filter values are case-sensitive from this version on (the
	// API's page), as Azure names them: armRegionName "eastus",
	// armSkuName "Standard_NC4as_T4_v3".
	q.Set("$filter", fmt.Sprintf("serviceName eq 'Virtual Machines' and priceType eq 'Consumption' and armRegionName eq '%s' and armSkuName eq '%s'",
		odataQuote(m.Zone), odataQuote(m.InstanceType)))
	next := rp.URL + "?" + q.Encode()
	for range maxPricePages {
		page, err := rp.get(ctx, next)
		if err != nil {
			return record.Price{}, err
		}
		for _, it := range page.Items {
			if it.ArmSkuName != m.InstanceType || it.ArmRegionName != m.Zone || it.Type != "Consumption" || it.UnitOfMeasure != "1 Hour" ||
				strings.HasSuffix(it.ProductName, " Windows") || strings.HasSuffix(it.SkuName, " Low Priority") ||
				strings.HasSuffix(it.SkuName, " Spot") != m.Spot || it.RetailPrice <= 0 {
				continue
			}
			return record.Price{PerHour: it.RetailPrice, Currency: it.CurrencyCode, Source: SourceRetail}, nil
		}
		if page.NextPageLink == "" {
			break
		}
		next = page.NextPageLink
	}
	market := "pay-as-you-go"
	if m.Spot {
		market = "Spot"
	}
	return record.Price{}, fmt.Errorf("azure retail prices: no %s Linux price for %s in %s: %w", market, m.InstanceType, m.Zone, provider.ErrNotPriced)
}

// odataQuote doubles the quotes of a value in an OData string literal.
func odataQuote(s string) string { return strings.ReplaceAll(s, "'", "''") }

// get reads one page. A 4xx but 429 is an error no retry fixes (a filter
// refused); 429 and 5xx may pass.
func (rp *RetailPrices) get(ctx context.Context, u string) (retailPage, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return retailPage{}, fmt.Errorf("azure retail prices: %w", err)
	}
	req.Header.Set("Accept", "application/json")
	res, err := rp.Client.Do(req)
	if err != nil {
		return retailPage{}, fmt.Errorf("azure retail prices: %w", err)
	}
	defer res.Body.Close()
	body, err := io.ReadAll(io.LimitReader(res.Body, 4<<20))
	if err != nil {
		return retailPage{}, fmt.Errorf("azure retail prices: %w", err)
	}
	if res.StatusCode != http.StatusOK {
		err := fmt.Errorf("azure retail prices: %s: %s", res.Status, strings.TrimSpace(string(body[:min(len(body), 300)])))
		if res.StatusCode >= 400 && res.StatusCode < 500 && res.StatusCode != http.StatusTooManyRequests {
			return retailPage{}, provider.Rejected(err)
		}
		return retailPage{}, err
	}
	var page retailPage
	if err := json.Unmarshal(body, &page); err != nil {
		return retailPage{}, fmt.Errorf("azure retail prices: the answer is no price list: %w", err)
	}
	return page, nil
}
