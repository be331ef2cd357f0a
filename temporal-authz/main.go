// Command temporal-authz is the Temporal server (all services, configured like
// `temporal-server start`) with gpucloud's own ClaimMapper and Authorizer: every frontend call
// is authorised by the identity its short-lived signed token names (core/temporal_identity.py
// mints them; docs/temporal.md, "Identities and the Authorizer").
package main

import (
	"fmt"
	stdlog "log"
	"os"
	"path"
	_ "time/tzdata" // the stock main embeds it too: schedules need zone data on bare hosts

	"github.com/urfave/cli/v2"
	"go.temporal.io/server/common/authorization"
	"go.temporal.io/server/common/config"
	"go.temporal.io/server/common/dynamicconfig"
	"go.temporal.io/server/common/log"
	_ "go.temporal.io/server/common/persistence/sql/sqlplugin/postgresql" // the cluster mode's store
	_ "go.temporal.io/server/common/persistence/sql/sqlplugin/sqlite"     // the embedded mode's store
	"go.temporal.io/server/temporal"
)

// PolicyEnv names the policy file (policy.go): the token keys and the names a node may use.
// TEMPORAL_ like the server's own variables (TEMPORAL_ROOT, ...): it configures the server.
const PolicyEnv = "TEMPORAL_AUTHZ_POLICY"

func main() {
	app := cli.NewApp()
	app.Name = "temporal-authz"
	app.Usage = "Temporal server with gpucloud's token identities and authorizer"
	app.Flags = []cli.Flag{
		&cli.StringFlag{Name: "root", Aliases: []string{"r"}, Value: ".", EnvVars: []string{config.EnvKeyRoot}},
		&cli.StringFlag{Name: "config", Aliases: []string{"c"}, Value: "config", EnvVars: []string{config.EnvKeyConfigDir}},
		&cli.StringFlag{Name: "env", Aliases: []string{"e"}, Value: "development", EnvVars: []string{config.EnvKeyEnvironment}},
		&cli.StringFlag{Name: "zone", Aliases: []string{"az"}, EnvVars: []string{config.EnvKeyAvailabilityZone}},
		&cli.StringFlag{Name: "policy", Usage: "authorization policy file (JSON)", EnvVars: []string{PolicyEnv}},
	}
	app.Commands = []*cli.Command{{
		Name:  "start",
		Usage: "Start the Temporal server",
		Flags: []cli.Flag{
			&cli.StringSliceFlag{
				Name:    "service",
				Aliases: []string{"svc"},
				Value:   cli.NewStringSlice(temporal.DefaultServices...),
				Usage:   "service(s) to start",
			},
		},
		Action: start,
	}}
	if err := app.Run(os.Args); err != nil {
		stdlog.Fatal(err)
	}
}

func start(c *cli.Context) error {
	// No policy, no server: this main exists to enforce one, never to fall back to "allow all".
	if c.String("policy") == "" {
		return cli.Exit(fmt.Sprintf("%s (or --policy) must name the authorization policy", PolicyEnv), 1)
	}
	policy, err := LoadPolicy(c.String("policy"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("Unable to load the authorization policy: %v", err), 1)
	}
	cfg, err := config.LoadConfig(c.String("env"), path.Join(c.String("root"), c.String("config")), c.String("zone"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("Unable to load configuration: %v.", err), 1)
	}
	logger := log.NewZapLogger(log.BuildZapLogger(cfg.Log))

	var dynamicConfigClient dynamicconfig.Client = dynamicconfig.NewNoopClient()
	if cfg.DynamicConfigClient != nil {
		dynamicConfigClient, err = dynamicconfig.NewFileBasedClient(cfg.DynamicConfigClient, logger, temporal.InterruptCh())
		if err != nil {
			return cli.Exit(fmt.Sprintf("Unable to create dynamic config client: %v", err), 1)
		}
	}

	mapper := &TokenClaimMapper{Keys: policy.PublicKeys}
	server, err := temporal.NewServer(
		temporal.ForServices(c.StringSlice("service")),
		temporal.WithConfig(cfg),
		temporal.WithDynamicConfigClient(dynamicConfigClient),
		temporal.WithLogger(logger),
		temporal.InterruptOn(temporal.InterruptCh()),
		temporal.WithAuthorizer(&Authorizer{Policy: policy, Logger: logger}),
		temporal.WithClaimMapper(func(*config.Config) authorization.ClaimMapper { return mapper }),
	)
	if err != nil {
		return cli.Exit(fmt.Sprintf("Unable to create server: %v.", err), 1)
	}
	if err := server.Start(); err != nil {
		return cli.Exit(fmt.Sprintf("Unable to start server: %v", err), 1)
	}
	return cli.Exit("All services are stopped.", 0)
}
