//! Handler functions that take, after their message, up to four values from
//! their [`Context`](super::context::Context): `async fn(M, Context)`, `async fn(M, State<A>)`,
//! `async fn(M, Context, State<A>, State<B>)`, … (each a [`FromContext`]
//! type). The context is made once per call, each value taken from it in
//! order, and dropped before the function's future runs.

use std::error::Error as StdError;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Weak;

use crate::envelope::message::Message;
use crate::envelope::stamp::HandlerResult;
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::middleware::short_type_name;
use crate::pipeline::bus::BusInner;
use crate::pipeline::context::{FromContext, RequiredState};
use crate::pipeline::handler::{
    context_of, erase, message_of, BoxedHandler, ErasedHandler, IntoHandler, IsFn,
};
use crate::BoxFuture;

/// A function of the message and the values `X` (a tuple of
/// [`FromContext`] types), erased.
struct ExtractFn<F, M, X> {
    f: F,
    name: &'static str,
    _m: PhantomData<fn(M, X)>,
}

/// The [`IntoHandler`] and erased-handler implementations for functions
/// of the message and the extractors `$x`.
macro_rules! extracting {
    ($($x:ident),+) => {
        impl<F, Fut, M, T, E, $($x),+> IntoHandler<M, (IsFn, $($x,)+)> for F
        where
            M: Message + Clone,
            F: Fn(M, $($x),+) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<T, E>> + Send,
            T: Send + Sync + 'static,
            E: StdError + Send + Sync + 'static,
            $($x: FromContext,)+
        {
            type Output = T;
            type Error = E;

            fn into_handler(self) -> BoxedHandler<M> {
                BoxedHandler::new(ExtractFn::<F, M, ($($x,)+)> {
                    f: self,
                    name: short_type_name(std::any::type_name::<F>()),
                    _m: PhantomData,
                })
            }
        }

        impl<F, Fut, M, T, E, $($x),+> ErasedHandler for ExtractFn<F, M, ($($x,)+)>
        where
            M: Message + Clone,
            F: Fn(M, $($x),+) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<T, E>> + Send,
            T: Send + Sync + 'static,
            E: StdError + Send + Sync + 'static,
            $($x: FromContext,)+
        {
            #[allow(non_snake_case)]
            fn call<'a>(
                &'a self,
                envelope: &'a Envelope,
                bus: &'a Weak<BusInner>,
            ) -> BoxFuture<'a, Result<HandlerResult, BoxError>> {
                Box::pin(async move {
                    let message = message_of::<M>(envelope)?;
                    let ctx = context_of(bus, envelope, self.name)?;
                    $(let $x = $x::from_context(&ctx)?;)+
                    drop(ctx);
                    erase((self.f)(message.clone(), $($x),+).await)
                })
            }

            fn name(&self) -> &'static str {
                self.name
            }

            fn rename(&mut self, name: &'static str) {
                self.name = name;
            }

            fn required_state(&self) -> Vec<RequiredState> {
                [$($x::required_state()),+].into_iter().flatten().collect()
            }
        }
    };
}

extracting!(X1);
extracting!(X1, X2);
extracting!(X1, X2, X3);
extracting!(X1, X2, X3, X4);
