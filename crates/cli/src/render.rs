//! `lily render`: prints the prompt the chat template makes of a conversation, exactly (no
//! newline added), or its token ids. The command-line contract of issue 3:
//!
//!   lily render --model DIR --chat FILE.json [--tools FILE.json] [--no-generation-prompt]
//!               [--template-kwargs JSON] [--ids]
//!
//! Why: to inspect and diff prompts against other engines (`tools/template_ref/render.py` takes
//! the same arguments), and to script prompt → ids without writing code.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{Map, Value};

use lily::tokenizer::{ChatTemplate, Tokenizer};

#[derive(Args, Debug)]
pub struct RenderArgs {
    /// Checkpoint directory (chat_template.jinja or tokenizer_config.json; tokenizer.json for --ids).
    #[arg(long)]
    pub model: PathBuf,
    /// Conversation JSON: OpenAI-style {"messages": [...]} (its "tools" and "chat_template_kwargs"
    /// are used too) or a bare array of messages; `-` reads stdin.
    #[arg(long)]
    pub chat: PathBuf,
    /// Tools JSON: an array of tool schemas or {"tools": [...]} (replaces the chat file's tools).
    #[arg(long)]
    pub tools: Option<PathBuf>,
    /// Leave out the assistant header that starts the model's turn.
    #[arg(long)]
    pub no_generation_prompt: bool,
    /// Extra template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON")]
    pub template_kwargs: Option<String>,
    /// Print the token ids (comma-separated) instead of the text.
    #[arg(long)]
    pub ids: bool,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("cannot read stdin")?;
        s
    } else {
        std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?
    };
    serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))
}

pub fn run(args: RenderArgs) -> Result<()> {
    let chat = read_json(&args.chat)?;
    let (messages, mut tools, mut kwargs) = match chat {
        Value::Array(_) => (chat, None, Map::new()),
        Value::Object(mut o) => {
            let Some(m) = o.remove("messages") else {
                bail!(
                    "{}: expected {{\"messages\": [...]}} or an array of messages",
                    args.chat.display()
                );
            };
            let kw = match o.remove("chat_template_kwargs") {
                Some(Value::Object(kw)) => kw,
                None | Some(Value::Null) => Map::new(),
                Some(_) => bail!(
                    "{}: chat_template_kwargs must be an object",
                    args.chat.display()
                ),
            };
            (m, o.remove("tools").filter(|t| !t.is_null()), kw)
        }
        _ => bail!(
            "{}: expected {{\"messages\": [...]}} or an array of messages",
            args.chat.display()
        ),
    };
    if let Some(p) = &args.tools {
        tools = Some(match read_json(p)? {
            Value::Object(mut o) => o.remove("tools").with_context(|| {
                format!("{}: expected an array or {{\"tools\": [...]}}", p.display())
            })?,
            v => v,
        });
    }
    if let Some(s) = &args.template_kwargs {
        match serde_json::from_str::<Value>(s).context("--template-kwargs: not valid JSON")? {
            Value::Object(o) => kwargs.extend(o),
            _ => bail!(
                "--template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}'"
            ),
        }
    }
    let template = ChatTemplate::from_dir(&args.model)?;
    let prompt = template.render(
        &messages,
        tools.as_ref(),
        !args.no_generation_prompt,
        &kwargs,
    )?;
    let mut out = std::io::stdout().lock();
    if args.ids {
        let tok = Tokenizer::from_dir(&args.model)?;
        let ids = tok.encode(&prompt)?;
        writeln!(
            out,
            "{}",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )?;
    } else {
        out.write_all(prompt.as_bytes())?;
    }
    out.flush()?;
    Ok(())
}
