//! Shell completion: clap's script for verbs, flags and kinds, and for bash also the
//! names of stored objects after `get`, `describe` and `delete KIND` (issue 78, item 7),
//! asked of the store by the hidden verb `moorctl __complete`.

use std::time::Duration;

use clap::{CommandFactory, Parser};

use super::{kind, Cli, Command, Ctx};
use moor::api::Namespace;

/// How long a completion may wait for the store: a shell is waiting.
const STORE_BOUND: Duration = Duration::from_secs(2);

/// Wraps clap's `_moorctl`: when `moorctl __complete` names objects for the word under
/// the cursor, those are offered; otherwise clap's completion runs as before.
const BASH_OBJECTS: &str = r#"
# Object names from the store after `get`, `describe` and `delete KIND`
# (`moorctl __complete`, bounded at 2 s); everything else as above.
_moorctl_objects() {
    local names
    names=$("${COMP_WORDS[0]}" __complete -- "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null)
    if [[ -n "$names" ]]; then
        local IFS=$'\n'
        COMPREPLY=($(compgen -W "$names" -- "${COMP_WORDS[COMP_CWORD]}"))
        return 0
    fi
    _moorctl "$@"
}
if [[ "${BASH_VERSINFO[0]}" -eq 4 && "${BASH_VERSINFO[1]}" -ge 4 || "${BASH_VERSINFO[0]}" -gt 4 ]]; then
    complete -F _moorctl_objects -o nosort -o bashdefault -o default moorctl
else
    complete -F _moorctl_objects -o bashdefault -o default moorctl
fi
"#;

/// `moorctl completion SHELL`.
pub fn script(shell: clap_complete::Shell) -> String {
    let mut cmd = Cli::command();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "moorctl", &mut script);
    let mut script = String::from_utf8_lossy(&script).into_owned();
    if shell == clap_complete::Shell::Bash {
        script.push_str(BASH_OBJECTS);
    }
    script
}

/// What the words typed so far ask a name for: the kind and the namespace (`None`:
/// all). `None` unless `typed`, the last word, is the NAME of a `get`, `describe` or
/// `delete` that parses (clap's own parse, flags anywhere).
fn wanted(cli: &Cli, typed: &str) -> Option<(kind::Kind, Option<Namespace>)> {
    let (kind, ns, name) = match &cli.command {
        Command::Get(g) => (g.kind, g.ns.filter().ok()?, g.name.as_deref()?),
        Command::Describe(d) => (d.kind, Some(Namespace::new(&d.namespace).ok()?), &*d.name),
        Command::Delete(d) => (d.kind, Some(Namespace::new(&d.namespace).ok()?), &*d.name),
        _ => return None,
    };
    (name == typed).then_some((kind, ns))
}

/// `moorctl __complete -- WORDS...` (WORDS: what follows `moorctl`, the one under the
/// cursor last): prints the names of stored objects that word may be, one per line.
/// Prints nothing, and exits 0, for anything else or a store that does not answer.
pub fn names(words: Vec<String>) -> anyhow::Result<i32> {
    let typed = words.last().cloned().unwrap_or_default();
    let argv = std::iter::once("moorctl".to_string()).chain(words);
    let Ok(cli) = Cli::try_parse_from(argv) else {
        return Ok(0);
    };
    let Some((kind, ns)) = wanted(&cli, &typed) else {
        return Ok(0);
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let found = rt.block_on(async {
        let store = cli
            .auth
            .connect_within(&cli.endpoints, &cli.prefix, STORE_BOUND)
            .await?;
        let ctx = Ctx {
            store,
            endpoints: cli.endpoints.clone(),
            retry_for: Duration::ZERO,
        };
        // The store's deadline (STORE_BOUND, from connect_within) bounds the list.
        kind::list(&ctx, kind, ns.as_ref()).await
    });
    let Ok((objects, _)) = found else {
        return Ok(0);
    };
    let mut names: Vec<&str> = objects
        .iter()
        .filter_map(|o| o.pointer("/metadata/name")?.as_str())
        .filter(|n| n.starts_with(&typed))
        .collect();
    names.sort_unstable();
    names.dedup();
    for n in names {
        crate::outln!("{n}");
    }
    Ok(0)
}
