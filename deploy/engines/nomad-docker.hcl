# Nomad's docker driver: a task on a moor volume, through the volume-plugin endpoint
# of the agent on the client node (Docker finds it at /run/docker/plugins/moor.sock).
# The volume is created on first use with the driver options below. The client's
# docker plugin must allow volumes: plugin "docker" { config { volumes { enabled = true } } }.
job "db" {
  group "db" {
    task "postgres" {
      driver = "docker"
      config {
        image = "postgres:16"
        mount {
          type   = "volume"
          target = "/var/lib/postgresql/data"
          source = "pgdata"
          volume_options {
            driver_config {
              name = "moor"
              options {
                size = "10GiB"
                mode = "single-node-writer"
              }
            }
          }
        }
      }
    }
  }
}
